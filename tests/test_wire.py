"""Messages declared once (compressors/wire.py): the layout's alignment, pack and unpack
(views of each field, one message or one per rank), refusals of a field of the wrong size or
dtype, and docs/wire.md as the methods declare their messages."""
from pathlib import Path

import pytest
import torch

import gradcomp
from gradcomp.compressors import wire
from gradcomp.compressors.wire import Field, Message

MSG = Message("test", Field("a", torch.uint8, "n", "bytes"),
              Field("b", torch.float32, "2 * m", "floats"),
              Field("c", torch.int16, "m", "shorts"))


def test_fields_start_on_their_alignment_and_round_trip():
    lay = MSG.bind(n=3, m=5)
    assert lay.spans == {"a": (0, 3, torch.uint8), "b": (4, 10, torch.float32),
                         "c": (44, 5, torch.int16)}
    assert lay.nbytes == 54
    a = torch.tensor([1, 2, 3], dtype=torch.uint8)
    b = torch.arange(10, dtype=torch.float32) - 4.5
    c = torch.arange(5, dtype=torch.int16) * -300
    msg = lay.pack(a=a, b=b, c=c)
    assert msg.dtype == torch.uint8 and msg.numel() == 54
    assert msg[3] == 0  # the alignment byte
    got = lay.unpack(msg)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b) and torch.equal(got["c"], c)
    # every rank's message, in rank order: (W, nbytes) -> (W, count) per field
    rows = lay.unpack(torch.stack([msg, lay.pack(a=a + 1, b=b * 2, c=c + 7)]))
    assert rows["b"].shape == (2, 10) and torch.equal(rows["b"][1], b * 2)
    assert torch.equal(rows["c"][1], c + 7)


def test_one_message_per_row_and_empty_fields():
    lay = MSG.bind(n=1, m=0)
    msgs = lay.pack(3, a=torch.tensor([5, 6, 7], dtype=torch.uint8),
                    b=torch.empty(0), c=torch.empty(0, dtype=torch.int16))
    assert msgs.shape == (3, 4)  # 1 byte, 3 of alignment before the (empty) floats
    got = lay.unpack(msgs)
    assert got["a"].flatten().tolist() == [5, 6, 7] and got["b"].shape == (3, 0)


@pytest.mark.parametrize("bad", [{"b": torch.zeros(9)}, {"b": torch.zeros(10, dtype=torch.float64)},
                                 {"d": torch.zeros(1)}])
def test_a_field_of_the_wrong_size_or_dtype_is_named(bad):
    lay = MSG.bind(n=1, m=5)
    values = {"a": torch.zeros(1, dtype=torch.uint8), "b": torch.zeros(10),
              "c": torch.zeros(5, dtype=torch.int16), **bad}
    with pytest.raises(ValueError, match="message 'test'"):
        lay.pack(**values)
    with pytest.raises(ValueError, match="54 bytes|expected"):
        lay.unpack(torch.zeros(53, dtype=torch.uint8))


def test_every_compressing_method_declares_its_messages():
    for m in gradcomp.methods():
        cls = gradcomp.compressors.METHODS[m["name"]].compressor
        if m["name"] != "allreduce":
            assert cls.messages, m["name"]


def test_the_docs_page_is_what_the_methods_declare():
    path = Path(__file__).resolve().parents[1] / "docs" / "wire.md"
    assert path.read_text() == wire.docs(), (
        "docs/wire.md is stale: python -c \"from gradcomp.compressors import wire; wire.main()\"")
