"""Method configurations: frozen dataclasses validated on construction."""
from __future__ import annotations

import dataclasses
import enum
import math
import typing
from typing import Final
from dataclasses import dataclass

from . import rules

# Tensors with fewer elements than this go uncompressed: below it the compressed message plus
# its metadata saves less than a round trip costs. 4096 elements = 16 KiB, about 0.13 ms at
# 1 Gbit/s.
DEFAULT_MIN_NUMEL = 4096
TOPOLOGIES = ("auto", "flat", "hierarchical")
WARMUPS = ("auto", "adaptive", "none")


class Adam(str, enum.Enum):
    """The ``adam`` option's values (the config holds the member; it equals, hashes, prints
    and formats as its string, so dict keys and messages take either)."""

    __hash__ = str.__hash__
    __str__ = str.__str__
    __format__ = str.__format__

    AUTO = "auto"
    PRECONDITION = "precondition"
    MOMENTUM = "momentum"
    FREEZE = "freeze"
    OFF = "off"


ADAMS = tuple(a.value for a in Adam)
DENSE_WIRES = ("auto", "float32", "bfloat16", "int8", "int4")
# The slots the methods keep (memory.py; typed constants: a checkpoint's memory is keyed
# by them)
RESIDUAL: Final = "residual"                # error feedback's residual (every EF method)
SERVER_RESIDUAL: Final = "server_residual"  # onebit: the residual of its second stage
VELOCITY: Final = "velocity"                # dgc: its momentum-corrected velocity
TAU: Final = "tau"                          # threshold: each parameter's adaptive threshold

# bounds on what an option costs, checked before anything is allocated or sent: a value past
# them is a typo far more often than a plan (each delayed step holds a copy of the gradients
# in flight; a run syncs once per local_steps steps; a window's norms are kept until it ends)
MAX_DELAY = 64
MAX_LOCAL_STEPS = 100_000
MAX_STEPS = 2**53  # a step count that is still an exact float64


# characters of a user's value quoted in a message: a message stays short whatever it was
# given (a 10 KB spec string is quoted cut, not whole)
MAX_QUOTED = 400


def clip(text, limit: int = MAX_QUOTED) -> str:
    """``text`` (a string, or any value: its repr) cut to about ``limit`` characters: its
    beginning and its end (where a message says what is allowed), the cut marked."""
    text = text if isinstance(text, str) else repr(text)
    if len(text) <= limit:
        return text
    tail = limit // 3
    return f"{text[: limit - tail - 30]} ...({len(text)} characters)... {text[-tail:]}"


def quote(value, limit: int = 80) -> str:
    """A user's value as a message quotes it: its repr, cut to ``limit`` characters."""
    return clip(repr(value), limit)


def check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}={value!r}: allowed {allowed}")


# the rounds' options as they are without local steps: an exchange every optimizer step (a
# probe's config, hooks/topology.py)
ONE_STEP_EACH = {"local_steps": 1, "local_delay": 0, "sync_steps": 0, "fragments": 1}


@dataclass(frozen=True)
class MethodConfig:
    """Options every method has.

    min_numel: tensors smaller than this many elements are sent uncompressed.
    error_feedback: keep what compression dropped and add it to the next step's gradient.
    warmup: how a compressing method starts. "adaptive": steps go as a plain fp32 allreduce
        until the gradients leave the early critical regime, then compressed for good
        (Accordion, Agarwal et al., MLSys 2021; the rule: hooks/warmup.py); "none": compressed
        from the first step; "auto" (the default): "adaptive" when syncing every step,
        "none" with ``local_steps`` > 1 (the rule counts outer rounds, too few in a run for
        its windows; SparseLoCo compresses from the first round). The first steps' large,
        fast-changing gradients are where compression error hurts most.
    warmup_window: steps per window of the adaptive rule (the root-mean-square gradient norm
        of consecutive windows is compared; compression starts at a window boundary).
    warmup_threshold: the adaptive rule's eta: compression starts once the norm of a window
        differs from the previous one's by less than this fraction of it.
    warmup_max_steps: compression starts at the latest at this step (0: no cap).
    dense_steps: the explicit override: exactly the first dense_steps optimizer steps go as a
        plain fp32 allreduce (as in 1-bit Adam's warm-up, Tang et al. 2021, and torch's
        start_powerSGD_iter), whatever ``warmup`` says; None: ``warmup`` decides.
    seed: seeds every random stream of the method (same on all ranks).
    delay: delayed gradient averaging (Zhu et al., NeurIPS 2021): apply the local gradient at
        once and the average ``delay`` steps later; 0 = synchronous.
    topology: "flat" (every rank in one compressed exchange), "hierarchical" (dense
        reduce-scatter inside a node, the compressed exchange of each shard between the
        nodes' ranks of the same local index, dense allgather inside the node) or "auto"
        (hierarchical when the job spans several nodes of several ranks each).
    local_size: ranks per node for the hierarchy (0: torchrun's LOCAL_WORLD_SIZE).
    local_steps: H > 1 syncs every H optimizer steps instead of every step (DiLoCo,
        Douillard et al. 2023): inner steps send nothing across nodes; every H steps the
        pseudo-gradient (round start - parameters) goes through the method, with its error
        feedback, and an outer SGD-Nesterov step (``outer_lr``, ``outer_momentum``) applies
        the average. 1 = every step (the usual path). See hooks/local_steps.py.
    grow_every, max_local_steps: with local_steps > 1 and grow_every = N > 0, the rounds
        grow: a round that starts at or after N steps of rounds is twice ``local_steps``
        long, at or after 2N twice that, and so on up to ``max_local_steps`` (local SGD
        with a growing period, Haddadpour et al., NeurIPS 2019); the outer learning rate of
        a round of H steps is ``outer_lr`` * sqrt(H / local_steps). 0: every round
        ``local_steps`` long. ``max_local_steps`` 0: no cap below MAX_LOCAL_STEPS.
    outer_lr, outer_momentum: the outer optimizer's learning rate and Nesterov momentum.
    local_delay: 1 overlaps a round's outer exchange with the next round's inner steps and
        applies it one round late (Streaming DiLoCo, Douillard et al. 2025); 0 = at once.
    fragments: with local_steps > 1, the parameters in N groups of about equal size (module
        order), each exchanged every ``local_steps`` steps at its own offset in the round
        (Streaming DiLoCo's fragments): the peak bytes of one exchange fall N-fold. 1 = the
        whole model at the round's end.
    sync_steps: with local_steps > 1, the first N optimizer steps synchronous (Post-local
        SGD, Lin et al., ICLR 2020): each step's gradient averaged over every rank, in
        ``dense_wire``, and the rounds start after them; with Adam/AdamW (``adam`` "auto"
        or "freeze") the second moment those steps learned stays frozen for the inner steps
        (0/1 Adam, Lu et al. 2023). 0: local from the first step. Inert with local_steps=1
        (a method whose Adam defaults set it, run every step, is not refused over it).
    adam: with torch.optim.Adam/AdamW (``register(..., optimizer=opt)``): "momentum" keeps
        Adam's second moment as the dense warm-up left it for every parameter the method
        compresses and exchanges Adam's first moment instead of the gradient: each rank
        compresses its next m = beta1 m + (1 - beta1) g, with the method's error feedback,
        and the average becomes every rank's m (1-bit Adam, Tang et al., ICML 2021:
        hooks/optimizer/adam.py); "freeze" freezes the second moment the same way but compresses
        the gradient; "precondition" also compresses g / sqrt(v) instead of g (measured
        worse on the GPT, kept for comparison); "off" lets Adam see the compressed gradients
        as any other (its second moment then averages the squares of compressed values:
        measured to lose accuracy); "auto" (the default): with Adam/AdamW "momentum" for a
        method with error feedback under DDP and ``delay=0``, "freeze" otherwise (TernGrad,
        FSDP/HSDP, ``delay``); nothing without Adam.
    dense_wire: what the dense warm-up steps put on the wire: "float32" (a plain allreduce),
        "bfloat16" (each rank's gradient rounded to bf16 once, summed in fp32 by the rank
        owning each part, the average rounded to bf16 once: half the bytes, no bf16
        accumulation), "int8" (each parameter cut into rows of 256 with one fp32 scale each,
        rounded to 127 levels each side of 0, summed in fp32 by the rank owning each row,
        rounded again: about a quarter of the bytes; compressors/rows.py), "int4" (the same
        rows at 7 levels each side of 0: about an eighth) or "auto" (the
        default): "bfloat16" with Adam/AdamW, whose warm-up
        learns the second moment it then freezes (measured on the GPT: bench/RESULTS.md
        section 8), "float32" otherwise.
    exact: parameters sent uncompressed whatever their size: "|"-separated name patterns
        (fnmatch: "tok.weight|head.*"); "" (the default): none.
    keep_clip: with Adam/AdamW, keep a gradient clip applied between backward and
        ``step()`` (``clip_grad_norm_``) on the steps whose gradients are not DDP's exact
        average: the compressed steps, and local steps' inner steps after ``sync_steps``.
        False (the default): the clip is taken off those steps, announced once (its norm
        carries the compression error or one rank's noise: measured better off,
        docs/adam.md "Gradient clipping"); the dense steps keep it either way.
    With local_steps > 1 the method's step counter (``dense_steps``, the adaptive warm-up
    and its windows, random streams) counts outer rounds.
    """

    min_numel: int = DEFAULT_MIN_NUMEL
    error_feedback: bool = True
    seed: int = 0
    delay: int = 0
    warmup: str = "auto"
    warmup_window: int = 50
    warmup_threshold: float = 0.5
    warmup_max_steps: int = 0
    dense_steps: int | None = None
    topology: str = "auto"
    local_size: int = 0
    local_steps: int = 1
    grow_every: int = 0
    max_local_steps: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    local_delay: int = 0
    fragments: int = 1
    sync_steps: int = 0
    adam: str = "auto"
    exact: str = ""
    dense_wire: str = "auto"
    keep_clip: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            t = _field_type(type(self), f.name)
            if t is float and isinstance(v, int) and not isinstance(v, bool):
                object.__setattr__(self, f.name, float(v))
                v = float(v)
            if v is None and type(None) not in typing.get_args(t):
                raise TypeError(f"invalid {f.name}=None: expected {_type_name(t)} (None has no "
                                f"meaning for this option; leave it out for the default "
                                f"{f.default!r})")
            if v is not None and not _isinstance(v, t):
                raise TypeError(f"invalid {f.name}={v!r}: expected {_type_name(t)}")
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"invalid {f.name}={v!r}: allowed a finite number")
        check(0 <= self.min_numel <= 2**62, "min_numel", self.min_numel,
              "an integer in [0, 2**62]")
        check(0 <= self.delay <= MAX_DELAY, "delay", self.delay,
              f"an integer in [0, {MAX_DELAY}] (0 = synchronous; each delayed step keeps a "
              f"copy of the gradients in flight)")
        check(0 <= self.seed < 2**63, "seed", self.seed, "an integer in [0, 2**63)")
        check(self.dense_steps is None or 0 <= self.dense_steps <= MAX_STEPS, "dense_steps",
              self.dense_steps, "an integer >= 0, or None (the warm-up rule decides); at most 2**53")
        check(self.warmup in WARMUPS, "warmup", self.warmup,
              "auto (adaptive, or none with local_steps > 1), adaptive (dense until the "
              "gradient norm settles) or none")
        check(1 <= self.warmup_window <= MAX_LOCAL_STEPS, "warmup_window", self.warmup_window,
              f"an integer >= 1 and <= {MAX_LOCAL_STEPS}")
        check(0 < self.warmup_threshold < float("inf"), "warmup_threshold",
              self.warmup_threshold, "a finite number > 0")
        check(0 <= self.warmup_max_steps <= MAX_STEPS, "warmup_max_steps",
              self.warmup_max_steps, "an integer >= 0 (0: no cap) and <= 2**53")
        check(self.topology in TOPOLOGIES, "topology", self.topology, ", ".join(TOPOLOGIES))
        check(0 <= self.local_size <= 2**20, "local_size", self.local_size,
              "an integer in [0, 2**20] (0: LOCAL_WORLD_SIZE)")
        self._check_local_steps()
        check(self.dense_wire in DENSE_WIRES, "dense_wire", self.dense_wire,
              "auto (bfloat16 with Adam/AdamW, float32 otherwise), float32, bfloat16, int8 "
              "or int4")
        check(self.adam in ADAMS, "adam", self.adam,
              "auto (momentum or freeze with Adam/AdamW), momentum (Adam's second moment "
              "frozen once compression starts, its first moment exchanged), freeze (frozen, "
              "the gradient exchanged), precondition (frozen, g / sqrt(v) exchanged) or off")
        object.__setattr__(self, "adam", Adam(self.adam))
        rules.check(self)  # the rules between options (gradcomp/rules.py)
        self.validate()

    def _check_local_steps(self):
        check(1 <= self.local_steps <= MAX_LOCAL_STEPS, "local_steps", self.local_steps,
              f"an integer >= 1 and <= {MAX_LOCAL_STEPS} (1 = sync every step)")
        check(0 <= self.grow_every <= MAX_STEPS, "grow_every", self.grow_every,
              "an integer >= 0 (0: rounds of local_steps steps throughout) and <= 2**53")
        check(0 <= self.max_local_steps <= MAX_LOCAL_STEPS, "max_local_steps",
              self.max_local_steps, f"an integer >= 0 (0: no cap) and <= {MAX_LOCAL_STEPS}")
        check(0 < self.outer_lr <= 10, "outer_lr", self.outer_lr, "a number > 0 and <= 10")
        check(0 <= self.outer_momentum < 1, "outer_momentum", self.outer_momentum,
              "a number in [0, 1)")
        check(self.local_delay in (0, 1), "local_delay", self.local_delay,
              "0 (outer step at the round's end) or 1 (one round late, overlapped)")
        check(self.local_steps > 1 or self.local_delay == 0, "local_delay", self.local_delay,
              "0 unless local_steps > 1")
        check(1 <= self.fragments <= max(self.local_steps, 1), "fragments", self.fragments,
              f"an integer in [1, local_steps={self.local_steps}] (each fragment syncs at its "
              f"own step of the round)")
        check(0 <= self.sync_steps <= MAX_STEPS, "sync_steps", self.sync_steps,
              "an integer >= 0 and <= 2**53")
        check(self.local_steps == 1 or self.delay == 0, "delay", self.delay,
              f"0 with local_steps={self.local_steps} (inner steps send nothing to delay; "
              f"local_delay=1 overlaps the outer exchange instead)")

    @property
    def warmup_rule(self) -> str:
        """The warm-up that runs: "adaptive" or "none" ("auto" resolved by ``local_steps``)."""
        return self.warmup_rule_of({"warmup": self.warmup, "local_steps": self.local_steps})

    @staticmethod
    def warmup_rule_of(options: dict) -> str:
        """:attr:`warmup_rule` of a config's options as plain values (a checkpoint's)."""
        if options["warmup"] == "auto":
            local = options.get("local_steps", 1)
            return "none" if isinstance(local, int) and local > 1 else "adaptive"
        return options["warmup"]

    @property
    def steps_per_exchange(self) -> int:
        """Optimizer steps per exchange of a parameter: 1, or with local steps the round's
        ``local_steps`` (hooks/local_steps.py owns what happens between)."""
        return self.local_steps

    @property
    def in_rounds(self) -> bool:
        """Whether the method takes local steps: its exchange is an outer round's
        pseudo-gradient, the optimizer's own inner steps between (hooks/local_steps.py)."""
        return self.local_steps > 1

    @property
    def synchronous_start(self) -> bool:
        """Whether local steps begin with ``sync_steps`` synchronous steps (Adam's second
        moment then learned from averaged gradients, and frozen)."""
        return self.in_rounds and self.sync_steps > 0

    def validate(self) -> None:
        """Method-specific checks; raise ValueError naming the bad value."""

    def to_dict(self) -> dict:
        """Plain values (an enum's as its string: checkpoints load with weights_only)."""
        return {k: v.value if isinstance(v, enum.Enum) else v
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "MethodConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)}: allowed {', '.join(sorted(names))}")
        return cls(**d)

    @classmethod
    def options(cls) -> dict:
        """{name: (type name, default)} for every option."""
        return {f.name: (_type_name(_field_type(cls, f.name)), f.default) for f in dataclasses.fields(cls)}

    @classmethod
    def parse_value(cls, name: str, text: str):
        """Convert a spec-string value to the option's type."""
        t = _field_type(cls, name)
        base = [a for a in typing.get_args(t) if a is not type(None)][0] if typing.get_args(t) else t
        if text.lower() == "none" and base is not t:
            return None
        try:
            if base is bool:
                if text.lower() in ("1", "true", "yes", "on"):
                    return True
                if text.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(text)
            return base(text)
        except ValueError:
            raise ValueError(f"invalid {name}={text!r}: expected {_type_name(t)}") from None


def _field_type(cls, name):
    return typing.get_type_hints(cls)[name]


def _isinstance(v, t) -> bool:
    args = typing.get_args(t)
    if args:
        return any(_isinstance(v, a) for a in args if a is not type(None))
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if t is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, t)


def _type_name(t) -> str:
    args = typing.get_args(t)
    if args:
        return " or ".join(_type_name(a) for a in args)
    return getattr(t, "__name__", str(t))
