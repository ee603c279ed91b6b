"""Registration-time validation: every bad input names the value and what is allowed."""
import pytest
import torch

import gradcomp
from gradcomp.compressors.dgc import DGC
from gradcomp.hooks.optimizer import SGDMomentum, momentum_options


def test_methods_lists_every_method_with_options():
    got = {m["name"]: m for m in gradcomp.methods()}
    assert set(got) == {"allreduce", "topk", "dgc", "onebit", "terngrad", "powersgd", "threshold",
                        "sparseloco", "diloco"}
    assert got["sparseloco"]["options"]["local_steps"] == ("int", 4)  # its own default
    assert got["powersgd"]["options"]["rank"] == ("int", 4)
    assert got["dgc"]["options"]["ratio"] == ("float", 0.001)
    assert got["topk"]["options"]["ratio"] == ("float", 0.05)
    assert all(m["description"] for m in got.values())


def test_methods_shows_the_defaults_adam_and_adamw_get():
    """``adam_defaults``: the options register() sets otherwise with Adam/AdamW, each what a
    registration with AdamW and no options builds (dense_wire "auto" as it runs: bfloat16)."""
    from gradcomp.hooks.options import for_optimizer
    got = {m["name"]: m for m in gradcomp.methods()}
    assert got["diloco"]["adam_defaults"] == {"local_steps": 16, "sync_steps": 100,
                                              "outer_lr": 0.7, "outer_momentum": 0.9,
                                              "dense_wire": "int4", "adam": "off"}
    assert got["diloco"]["options"]["outer_lr"] == ("float", 1.5)  # with SGD
    assert got["onebit"]["adam_defaults"] == {"chunk": 64, "scales": "bfloat16",
                                              "dense_wire": "int4"}
    assert got["powersgd"]["adam_defaults"] == {"dense_wire": "bfloat16"}
    assert got["allreduce"]["adam_defaults"] == {}
    w = torch.nn.Parameter(torch.zeros(2))
    for opt in (torch.optim.AdamW([w]), torch.optim.Adam([w]), torch.optim.SGD([w], lr=0.1)):
        adam = not isinstance(opt, torch.optim.SGD)
        for name, m in got.items():
            built = for_optimizer(name, {}, opt)[1].to_dict()
            if adam and built["dense_wire"] == "auto" and "dense_wire" in m["adam_defaults"]:
                built["dense_wire"] = "bfloat16"  # what "auto" runs with Adam/AdamW
            want = {k: d for k, (_, d) in m["options"].items()}
            if adam:
                want.update(m["adam_defaults"])
            assert built == want, (name, type(opt).__name__)


def test_spec_string_is_parsed_and_typed():
    name, cfg = gradcomp.build_config("powersgd:rank=3,error_feedback=false,min_numel=0")
    assert (name, cfg.rank, cfg.error_feedback, cfg.min_numel) == ("powersgd", 3, False, 0)
    name, cfg = gradcomp.build_config("topk", ratio=1)
    assert cfg.ratio == 1.0 and isinstance(cfg.ratio, float)


@pytest.mark.parametrize("spec, kwargs, match", [
    ("nope", {}, r"unknown method 'nope': allowed .*dgc"),
    ("topk", {"ratio": 0}, r"invalid ratio=0.*\(0, 1\]"),
    ("topk", {"ratio": 1.5}, r"invalid ratio=1.5"),
    ("topk:ratio=-1", {}, r"invalid ratio=-1"),
    ("dgc", {"ratio": 2.0}, r"invalid ratio=2.0"),
    ("powersgd", {"rank": 0}, r"invalid rank=0: allowed an integer >= 1"),
    ("powersgd:rank=two", {}, r"invalid rank='two': expected int"),
    ("powersgd:bogus=1", {}, r"unknown option 'bogus' for powersgd: allowed .*rank"),
    ("topk", {"bogus": 1}, r"unknown option\(s\) bogus: allowed"),
    ("onebit", {"chunk": 12}, r"invalid chunk=12: allowed a positive multiple of 8"),
    ("topk:ratio=0.1", {"ratio": 0.2}, r"given both"),
    ("powersgd:rank", {}, r"expected key=value"),
])
def test_bad_options_raise_value_error(spec, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradcomp.build_config(spec, **kwargs)


def test_wrong_option_type_raises_type_error():
    with pytest.raises(TypeError, match=r"invalid rank=2.5: expected int"):
        gradcomp.build_config("powersgd", rank=2.5)


def test_register_refuses_a_model_that_is_not_ddp():
    with pytest.raises(TypeError, match=r"DistributedDataParallel model or a model sharded with "
                                         r"torch.distributed.fsdp.fully_shard, got Linear"):
        gradcomp.register(torch.nn.Linear(2, 2), "topk")


def test_config_round_trips_through_dict():
    _, cfg = gradcomp.build_config("dgc:ratio=0.01,warmup_steps=5")
    assert type(cfg).from_dict(cfg.to_dict()) == cfg


def test_dgc_reads_momentum_from_the_optimizer_and_hides_it_only_during_step():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    assert momentum_options({"ratio": 0.01}, opt, "dgc") == {"ratio": 0.01}  # read live, not copied
    dgc = DGC(DGC.Config(ratio=0.01))
    dgc.attach_momentum(SGDMomentum(opt, {id(p): "w"}, dgc.config.fixed(), "dgc"))
    g = opt.param_groups[0]
    assert (g["momentum"], g["nesterov"], g["weight_decay"]) == (0.9, True, 1e-4)
    assert dgc.live(["w"]) == (0.9, True, 1e-4)
    g["momentum"] = 0.5  # a scheduler, or the user
    assert dgc.live(["w"]) == (0.5, True, 1e-4)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(dict(o.param_groups[0])))
    p.grad = torch.ones(3)
    opt.step()
    # during step() the optimizer held no momentum and no weight decay: w -= lr * grad alone
    assert (seen[0]["momentum"], seen[0]["nesterov"], seen[0]["weight_decay"]) == (0.0, False, 0.0)
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.9))
    assert opt.state_dict()["param_groups"][0]["momentum"] == 0.5  # the user's, after step()
    # registering again (a resumed job) keeps one pair of hooks
    dgc2 = DGC(DGC.Config(ratio=0.01))
    dgc2.attach_momentum(SGDMomentum(opt, {id(p): "w"}, dgc2.config.fixed(), "dgc"))
    assert len(opt._optimizer_step_pre_hooks) == 2  # ours + the test's
    dgc2.unbind()
    assert opt.param_groups[0]["momentum"] == 0.5


def test_dgc_refuses_double_momentum_and_missing_optimizer():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(TypeError, match="optimizer="):
        momentum_options({}, None, "dgc")
    with pytest.raises(ValueError, match="applied twice"):
        momentum_options({"momentum": 0.5}, torch.optim.SGD([p], lr=0.1, momentum=0.9), "dgc")
    with pytest.raises(TypeError, match="torch.optim.SGD"):
        momentum_options({"momentum": 0.9}, torch.optim.Adam([p]), "dgc")
    with pytest.raises(ValueError, match="dampening=0.1"):
        momentum_options({}, torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.1), "dgc")
    with pytest.raises(ValueError, match="maximize"):
        momentum_options({}, torch.optim.SGD([p], lr=0.1, momentum=0.9, maximize=True), "dgc")
    # Adam without momentum in the hook is allowed: nothing to apply twice
    assert momentum_options({"momentum": 0.0}, torch.optim.Adam([p]), "dgc") == {"momentum": 0.0}
    # momentum given as an option with an optimizer that has none: fixed; a group that later
    # gains momentum (a cycling scheduler) raises at step() instead of applying it twice
    opt = torch.optim.SGD([p], lr=0.1)
    dgc = DGC(DGC.Config(**momentum_options({"momentum": 0.9}, opt, "dgc")))
    dgc.attach_momentum(SGDMomentum(opt, {id(p): "w"}, dgc.config.fixed(), "dgc"))
    assert dgc.live(["w"]) is None
    p.grad = torch.ones(3)
    opt.step()
    opt.param_groups[0]["momentum"] = 0.95
    with pytest.raises(ValueError, match="applied twice"):
        opt.step()
