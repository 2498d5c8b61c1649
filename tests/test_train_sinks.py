"""Smoke tests of the sinks training example (examples/train_sinks.py): gpt-oss's pattern (a
learnable sink per head, layers alternating a sliding window and full causal attention) on the
small GPT. CPU only and fast: the tiny model under the Triton interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import dataclasses
import math

import pytest
import torch

from examples import train_sinks
from examples.gpt_model import build_model
from examples.train_packed_lm import TINY_MODEL
from flexmask import masks, reference

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="flexmask on CPU needs TRITON_INTERPRET=1"
)


def test_model_alternates_windows_and_trains_its_sinks():
    model = train_sinks.add_sinks(build_model(dataclasses.replace(TINY_MODEL, n_layers=4), "flexmask", 0, "cpu"))
    kinds = [block.attn.attend.kind for block in model.blocks]
    assert kinds == ["sliding", "full", "sliding", "full"]  # layer 0 sliding, as gpt-oss
    sinks = train_sinks.sink_parameters(model)
    assert len(sinks) == 4 and all(p.shape == (TINY_MODEL.n_heads,) and p.dtype == torch.float32 for p in sinks)
    assert {id(p) for p in sinks} <= {id(p) for p in model.parameters()}  # the optimizer sees them


@needs_interpreter
def test_layer_attention_matches_the_reference():
    """Each kind of layer: flexmask with its mask and sinks against the float64 reference on the
    dense mask (documents, and documents inside the window), the sinks' gradient included."""
    seqlens, window = [[40, 24], [64]], 16
    layer_masks = train_sinks.layer_masks(seqlens, window, "cpu")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 64, 32, generator=gen)
    k, v = (torch.randn(2, 1, 64, 32, generator=gen) for _ in range(2))
    outs = {}
    for kind, spec in (("full", masks.document(seqlens)),
                       ("sliding", masks.document(seqlens) & masks.sliding_window(window - 1))):
        attend = train_sinks.SinkAttention(2, sliding=kind == "sliding")
        with torch.no_grad():
            attend.sinks.copy_(torch.tensor([1.5, -0.5]))
        out = outs[kind] = attend(q, k, v, layer_masks)
        ref, _ = reference.attention(q, k, v, spec, sinks=attend.sinks)
        assert (out.double() - ref).abs().max() < 1e-5, kind
        (got,), (want,) = (torch.autograd.grad(o.sum(), attend.sinks) for o in (out, ref))
        assert (got.double() - want).abs().max() < 1e-5 * max(1.0, float(want.abs().max())), kind
    assert (outs["full"] - outs["sliding"]).abs().max() > 1e-2  # the window cuts: each layer reads its own mask


def test_check_sink_gradients_names_the_layer():
    train_sinks.check_sink_gradients([[1e-3, 2e-3], [1e-3, 4e-4]])
    with pytest.raises(RuntimeError, match="step 2: the sinks of layer 1 got gradient norm 0.0"):
        train_sinks.check_sink_gradients([[1e-3, 2e-3], [1e-3, 0.0]])
    with pytest.raises(RuntimeError, match="step 1: the sinks of layer 0 got gradient norm nan"):
        train_sinks.check_sink_gradients([[math.nan, 2e-3]])


@needs_interpreter
def test_tiny_training_run(capsys):
    """The CPU command of the module docstring: the loss falls, every layer's sinks get gradients."""
    losses, norms = train_sinks.main(["--tiny", "--steps", "3"])
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert len(norms) == 3 and all(len(n) == TINY_MODEL.n_layers and min(n) > 0 for n in norms)
    out = capsys.readouterr().out
    assert "sinks |grad| per layer" in out and "every layer's sinks got gradients" in out
