"""Registration-time validation: every bad input names the value and what is allowed."""
import pytest
import torch

import gradcomp
from gradcomp.hooks.ddp import take_momentum


def test_methods_lists_every_method_with_options():
    got = {m["name"]: m for m in gradcomp.methods()}
    assert set(got) == {"allreduce", "topk", "dgc", "onebit", "terngrad", "powersgd", "threshold"}
    assert got["powersgd"]["options"]["rank"] == ("int", 2)
    assert got["dgc"]["options"]["ratio"] == ("float", 0.001)
    assert all(m["description"] for m in got.values())


def test_spec_string_is_parsed_and_typed():
    name, cfg = gradcomp.build_config("powersgd:rank=4,error_feedback=false,min_numel=0")
    assert (name, cfg.rank, cfg.error_feedback, cfg.min_numel) == ("powersgd", 4, False, 0)
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
    with pytest.raises(TypeError, match=r"DistributedDataParallel model, got Linear"):
        gradcomp.register(torch.nn.Linear(2, 2), "topk")


def test_config_round_trips_through_dict():
    _, cfg = gradcomp.build_config("dgc:ratio=0.01,warmup_steps=5")
    assert type(cfg).from_dict(cfg.to_dict()) == cfg


def test_dgc_momentum_moves_from_optimizer_once():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    opts = take_momentum(opt, {"ratio": 0.01})
    assert opts == {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4, "ratio": 0.01}
    g = opt.param_groups[0]
    assert (g["momentum"], g["nesterov"], g["weight_decay"]) == (0.0, False, 0.0)
    # registering again (a resumed job) finds the moved momentum, never loses or doubles it
    assert take_momentum(opt, {})["momentum"] == 0.9
    # an optimizer state dict saved after the move restores the same
    opt2 = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    opt2.load_state_dict(opt.state_dict())
    assert take_momentum(opt2, {})["momentum"] == 0.9


def test_dgc_refuses_double_momentum_and_missing_optimizer():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(TypeError, match="pass optimizer="):
        take_momentum(None, {})
    with pytest.raises(ValueError, match="applied twice"):
        take_momentum(torch.optim.SGD([p], lr=0.1, momentum=0.9), {"momentum": 0.5})
    with pytest.raises(TypeError, match="needs torch.optim.SGD, got Adam"):
        take_momentum(torch.optim.Adam([p]), {"momentum": 0.9})
    # Adam without momentum in the hook is allowed: nothing to apply twice
    assert take_momentum(torch.optim.Adam([p]), {"momentum": 0.0}) == {"momentum": 0.0}
