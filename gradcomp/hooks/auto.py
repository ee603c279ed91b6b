"""``method="auto"``: the fastest method on this job's link among those whose accuracy held
for this optimizer, chosen at registration by measurement.

1. Candidates: ``allreduce`` (a fast link may need no compression), and the methods whose
   defaults held where we measured them (each method's ``Compressor.measured``): with
   Adam/AdamW the GPT workload's (within ``optimizer.HOLDS_PCT`` of allreduce's validation
   loss, bench/RESULTS.md, "Accuracy with AdamW": :func:`optimizer.held`); with any other optimizer the
   ResNet-18 / SGD workload's (within ``SGD_HOLDS_POINTS`` top-1 points of allreduce at 12
   epochs, RESULTS, "Accuracy with SGD": ``measured["sgd_points"]``).
2. Every rank validates the options against every candidate, with the optimizer checks
   each would get (``auto`` takes the options every method shares: ``warmup``, ``delay``,
   ``seed``, ...), and the ranks agree before any probe runs (hooks/agree.py), so bad
   options raise on every rank, never hang, and whichever candidate wins registers.
3. The probe: each candidate exchanges the model's last bucket (DDP's first, at most one
   bucket's bytes: hooks/topology.py's probe bucket) over the job's own process group, on
   the real link, with a throwaway state compressing from the first step: one untimed
   exchange, then the median of ``topology.PROBE_REPEATS``, codec and link together.
   The seconds are all-reduced (MAX): every rank sees the slowest rank's and picks alike.
   A local-steps method (``sparseloco``, ``diloco``: a candidate with Adam/AdamW where its
   measured gap held) exchanges once per round: its seconds count divided by its
   ``local_steps``.
4. The fastest wins (ties: the earlier candidate, ``allreduce`` first). ``stats()`` holds
   every candidate's seconds, the choice, and the predicted
   exchange seconds per step (the probe's, scaled to the model's bytes); it is logged on
   the ``gradcomp`` logger.

What the probe does not see: overlap with backward (an exchange that overlaps compute costs
less than its seconds), the warm-up's dense steps, and a link whose speed changes later.
"""
from __future__ import annotations

import logging
from ..compressors import METHODS
from ..config import MethodConfig
from . import optimizer as optimizer_binding
from .options import for_optimizer
from .topology import PROBE_MAX_BYTES, probe_bucket, probe_config, time_exchanges

# a method held with SGD where its ``Compressor.measured["sgd_points"]`` (top-1 points against
# allreduce: ResNet-18 / CIFAR-10 with momentum SGD under OneCycleLR, 12 epochs, mean of 3
# seeds, every method at its defaults; bench/RESULTS.md, "Accuracy with SGD") lost at most this many
SGD_HOLDS_POINTS = 1.5
# the options every method takes (the MethodConfig base): what method="auto" accepts
SHARED = frozenset(MethodConfig.options())

log = logging.getLogger("gradcomp")


def candidates(optimizer, scaler=None) -> list[str]:
    """``allreduce`` and the methods whose defaults held for ``optimizer``'s kind (with a
    GradScaler, not those whose defaults take local steps: refused with one)."""
    if optimizer is not None and optimizer_binding.is_adam(optimizer):
        held = [m for m in optimizer_binding.held() if scaler is None
                or optimizer_binding.default_exchange(m) != optimizer_binding.LOCAL]
    else:
        points = {m: spec.compressor.measured.get("sgd_points") for m, spec in METHODS.items()}
        held = sorted(m for m, d in points.items() if d is not None and -d <= SGD_HOLDS_POINTS)
    return ["allreduce", *held]


def configs(options: dict, optimizer, scaler=None) -> dict:
    """{candidate: (name, config)} at its defaults for ``optimizer`` with ``options``;
    ValueError naming an option that not every method takes."""
    extra = sorted(set(options) - SHARED)
    if extra:
        raise ValueError(f"method='auto' with option(s) {', '.join(extra)}: they belong to "
                         f"one method; allowed with auto: {', '.join(sorted(SHARED))} (or name "
                         f"the method)")
    return {c: for_optimizer(c, options, optimizer) for c in candidates(optimizer, scaler)}


def pick(seconds: dict) -> str:
    """The candidate of fewest seconds; ties go to the earlier one (dict order)."""
    return min(seconds, key=lambda c: (seconds[c], list(seconds).index(c)))


def probe(make_state, configs: dict, named_params, group, bucket_bytes, device=None) -> dict:
    """Time each candidate's exchange of the probe bucket on ``device`` (the model's;
    collective: every rank, the same order); returns what ``state.method_probe`` holds."""
    cap = min(bucket_bytes or PROBE_MAX_BYTES, PROBE_MAX_BYTES)
    params = probe_bucket(named_params, cap)
    states = []
    for name, config in configs.values():
        states.append(lambda name=name, cfg=probe_config(config): make_state(name, cfg))
    times = time_exchanges(states, params, group, device)
    # a local-steps method exchanges once per round: its seconds per step
    seconds = {c: t / cfg.steps_per_exchange for (c, (_, cfg)), t in zip(configs.items(), times)}
    chosen = pick(seconds)
    probe_elems = params[-1].offset + params[-1].numel
    total = sum(p.numel() for _, p in named_params)
    out = {"seconds": seconds, "chosen": chosen, "bucket_bytes": 4 * probe_elems,
           "predicted_exchange_s_per_step": seconds[chosen] * total / probe_elems}
    log.info("gradcomp: method='auto' chose %s (probe of a %d-byte bucket, seconds per "
             "exchange: %s; about %.3g s of exchange per step)", chosen, 4 * probe_elems,
             ", ".join(f"{c} {s:.4g}" for c, s in seconds.items()),
             out["predicted_exchange_s_per_step"])
    return out
