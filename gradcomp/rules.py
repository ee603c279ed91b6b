"""Every rule between options, and between an option and the job it runs in (the adapter, the
optimizer, a GradScaler, an outer optimizer), in one table: :data:`RULES`. A rule is what is
refused, with the message that names it. The config checks the rules about its options alone
when it is built (gradcomp/config.py); each adapter (hooks/ddp.py, hooks/fsdp.py) checks the
rest at registration, inside the ranks' agreement (hooks/agree.py: every rank or none
raises). A single option's own range is its field's (the config's schema), not a rule. (The
``adam`` option's values compare as their strings: config.Adam is a str enum.)
docs/methods.md's "Option rules" table is generated from this one
(``python -c "from gradcomp import rules; rules.main()"``); tests/test_rules.py triggers
every rule by its example and checks the docs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

OPTIONS = "options"  # a rule about the options alone (checked by the config)
DDP, FSDP, HSDP = "DDP", "FSDP", "HSDP"
SHARDED = (FSDP, HSDP)
EVERY_ADAPTER = (DDP, FSDP, HSDP)


@dataclass(frozen=True)
class Job:
    """What a rule may read besides the options: the adapter (None: the options alone),
    whether ``optimizer=``, ``scaler=`` and ``outer_optimizer=`` were given."""

    adapter: str | None = None
    optimizer: bool = False
    scaler: bool = False
    outer_optimizer: bool = False

    @classmethod
    def given(cls, adapter: str, optimizer=None, scaler=None, outer_optimizer=None) -> "Job":
        """The job of a registration with these arguments (each given or None)."""
        return cls(adapter, optimizer is not None, scaler is not None,
                   outer_optimizer is not None)


@dataclass(frozen=True)
class Rule:
    """``refused(c, job)``: whether the config ``c`` is refused in ``job``; ``message``
    (formatted with ``c``, ``adam`` (the adam option's string) and ``kind`` (the adapter)),
    raised as a ValueError. ``where``: the adapters that check it, or OPTIONS.
    ``options``: what the rule is about (the docs' table); ``example``: options (and the
    job's ``Job`` fields; ``adapter`` defaults to the first of ``where``) that break it,
    which tests/test_rules.py checks."""

    options: tuple[str, ...]
    where: tuple[str, ...]
    refused: Callable = field(repr=False)
    message: str
    example: dict = field(default_factory=dict)


RULES: tuple[Rule, ...] = (
    # ------------------------------------------------------------ the options alone
    Rule(("adam", "local_steps"), (OPTIONS,),
         lambda c, job: c.local_steps > 1 and c.adam not in ("auto", "freeze", "off"),
         "invalid adam={adam!r}: allowed auto, freeze or off with local_steps={c.local_steps} "
         "(the inner steps are Adam's own; with sync_steps its second moment freezes)",
         {"local_steps": 4, "adam": "momentum"}),
    Rule(("adam", "local_steps", "sync_steps"), (OPTIONS,),
         lambda c, job: c.local_steps > 1 and c.adam == "freeze" and c.sync_steps == 0,
         "invalid adam={adam!r}: allowed auto or off with local_steps={c.local_steps} and "
         "sync_steps=0; 'freeze' freezes the second moment the synchronous steps learned: "
         "set sync_steps=N > 0",
         {"local_steps": 4, "adam": "freeze", "sync_steps": 0}),
    Rule(("adam", "delay"), (OPTIONS,),
         lambda c, job: c.adam == "momentum" and c.delay != 0,
         "invalid delay={c.delay!r}: allowed 0 with adam='momentum' (the late average would be "
         "applied to a later first moment than the one it was built from); adam='auto' or "
         "'freeze' with delay",
         {"adam": "momentum", "delay": 1}),
    # ------------------------------------------------------------ DDP
    Rule(("scaler", "delay"), (DDP,),
         lambda c, job: job.scaler and c.delay,
         "scaler= with delay={c.delay}: a GradScaler skips a step on the rank that overflowed, "
         "and with delay the others learn of it only {c.delay} steps later; use delay=0, or "
         "bfloat16 without a scaler",
         {"delay": 1, "scaler": True}),
    Rule(("local_steps", "optimizer"), (DDP,),
         lambda c, job: c.local_steps > 1 and not job.optimizer,
         "local_steps={c.local_steps} needs register(..., optimizer=opt): the outer step runs "
         "every {c.local_steps} calls of opt.step() (a step post-hook)",
         {"local_steps": 4, "optimizer": False}),
    Rule(("scaler", "local_steps"), (DDP,),
         lambda c, job: c.local_steps > 1 and job.scaler,
         "scaler= with local_steps={c.local_steps}: a GradScaler skips optimizer steps on the "
         "rank that overflowed, which would then end its rounds at other steps than the rest; "
         "use bfloat16 without a scaler",
         {"local_steps": 4, "scaler": True, "optimizer": True}),
    # ------------------------------------------------------------ FSDP2 and HSDP
    Rule(("delay",), SHARDED,
         lambda c, job: c.delay,
         "delay={c.delay} under {kind}: FSDP reduces each gradient into the optimizer's shard "
         "in the same backward; allowed delay=0",
         {"delay": 1}),
    Rule(("local_steps",), (FSDP,),
         lambda c, job: c.local_steps > 1,
         "local_steps={c.local_steps} under FSDP (a 1-D mesh): a rank holds only its shard, "
         "whose gradient needs every rank's each step; allowed 1, or HSDP (a 2-D mesh: local "
         "steps across the replicas, the node's reduce-scatter every step)",
         {"local_steps": 4}),
    Rule(("local_delay",), SHARDED,
         lambda c, job: c.local_delay,
         "local_delay={c.local_delay} under {kind}: allowed 0 (the outer exchange runs at the "
         "round's end)",
         {"local_steps": 4, "local_delay": 1, "adapter": HSDP}),
    Rule(("topology",), SHARDED,
         lambda c, job: c.topology == "hierarchical",
         "topology='hierarchical' under {kind}: allowed 'flat' or 'auto'; for dense traffic "
         "inside a node and compressed across nodes shard with a 2-D mesh (HSDP), which is "
         "that hierarchy",
         {"topology": "hierarchical"}),
    Rule(("scaler",), SHARDED,
         lambda c, job: job.scaler,
         "scaler= under {kind}: allowed None; train with "
         "MixedPrecisionPolicy(param_dtype=torch.bfloat16) (no loss scale)",
         {"scaler": True}),
    Rule(("adam",), SHARDED,
         lambda c, job: c.adam in ("precondition", "momentum"),
         "adam={adam!r} under {kind}: a rank holds only its shard of Adam's state; "
         "allowed 'auto' (freeze here), 'freeze' or 'off'",
         {"adam": "momentum"}),
    # ------------------------------------------------------------ every adapter
    Rule(("outer_optimizer", "local_steps"), EVERY_ADAPTER,
         lambda c, job: job.outer_optimizer and c.local_steps == 1,
         "outer_optimizer= with local_steps=1: there is no outer step; allowed with "
         "local_steps > 1 (or leave it out)",
         {"local_steps": 1, "outer_optimizer": True}),
)


def check(config, job: Job = Job()) -> None:
    """Raise the first rule ``config`` breaks in ``job`` (in the table's order): the rules
    about the options alone where ``job.adapter`` is None, else the adapter's."""
    where = OPTIONS if job.adapter is None else job.adapter
    for rule in RULES:
        if where in rule.where and rule.refused(config, job):
            raise ValueError(rule.message.format(c=config, adam=str(config.adam),
                                                 kind=job.adapter))


def table() -> str:
    """The rules as docs/methods.md's markdown table."""
    rows = ["| options | checked | refused with |", "|---|---|---|"]
    for rule in RULES:
        where = "building the config" if rule.where == (OPTIONS,) else ", ".join(rule.where)
        example = ", ".join(f"{k}={v!r}" for k, v in rule.example.items() if k != "adapter")
        rows.append(f"| {', '.join(f'`{o}`' for o in rule.options)} | {where} | "
                    f"{_sample(rule)} (e.g. {example}) |")
    return "\n".join(rows)


def _sample(rule: Rule) -> str:
    """The rule's message, its placeholders named."""
    return rule.message.replace("{c.", "{").replace("!r}", "}").replace("|", "\\|")


def main() -> None:
    """Print the table (docs/methods.md, "Option rules")."""
    print(table())
