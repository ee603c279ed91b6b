"""The option rules (gradcomp/rules.py): one table that the config and both adapters read.
Every rule has a message and an example that breaks it; the example is refused with that
message where the rule is checked (the config for the options alone, the adapter's check for
the rest); docs/methods.md's copy of the table is the table."""
from pathlib import Path
from types import SimpleNamespace

import pytest

import gradcomp
from gradcomp import rules

JOB_FIELDS = {"adapter", "optimizer", "scaler", "outer_optimizer"}


def _split(example):
    job = {k: v for k, v in example.items() if k in JOB_FIELDS}
    return {k: v for k, v in example.items() if k not in JOB_FIELDS}, job


@pytest.mark.parametrize("rule", rules.RULES, ids=lambda r: "+".join(r.options))
def test_every_rule_refuses_its_example_with_its_message(rule):
    assert rule.message and rule.options and rule.where and rule.example
    options, job = _split(rule.example)
    adapter = job.pop("adapter", rule.where[0])
    if adapter == rules.OPTIONS:  # refused where the config is built
        with pytest.raises(ValueError) as e:
            gradcomp.build_config("onebit", **options)
        given = SimpleNamespace(**{**vars(gradcomp.build_config("onebit")[1]), **options})
        want = rule.message.format(c=given, adam=options.get("adam"), kind=None)
    else:  # the config is valid; the adapter's check refuses it in this job
        config = gradcomp.build_config("onebit", **options)[1]
        with pytest.raises(ValueError) as e:
            rules.check(config, rules.Job(adapter, **job))
        want = rule.message.format(c=config, adam=str(config.adam), kind=adapter)
    assert str(e.value) == want


def test_a_config_no_rule_refuses_passes_every_adapter():
    config = gradcomp.build_config("diloco:local_steps=4")[1]
    for adapter in rules.EVERY_ADAPTER:
        if adapter != rules.FSDP:  # (local steps need a 2-D mesh)
            rules.check(config, rules.Job(adapter, optimizer=True))


def test_the_docs_table_is_the_rules_table():
    text = (Path(__file__).parent.parent / "docs" / "methods.md").read_text()
    assert rules.table() in text


def test_no_adapter_writes_a_rule_of_its_own():
    """The rules' messages appear in gradcomp/rules.py alone (no second copy in an adapter,
    the config or the local-steps component)."""
    root = Path(gradcomp.__file__).parent
    for p in root.rglob("*.py"):
        if p.name != "rules.py":
            text = p.read_text()
            for rule in rules.RULES:
                assert rule.message[:40] not in text, (p, rule.options)
