"""The scratch the grouped GEMMs' launches share (split-K workspaces, the dynamic schedule's
counter): one per (device, stream, kind), made on first use and kept. Runs on any machine: the
current stream is stood in for."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from megamoe_kernels.shim import expert_gemm


def test_stream_scratch_is_made_once_per_device_stream_and_kind(monkeypatch):
    current = SimpleNamespace(cuda_stream=1)
    monkeypatch.setattr(expert_gemm, "_current_stream_handle", lambda device: current.cuda_stream)
    monkeypatch.setattr(expert_gemm, "_STREAM_SCRATCH", {})
    made = []

    def make():
        made.append(object())
        return made[-1]

    first_device, second_device = torch.device("cuda", 0), torch.device("cuda", 1)
    counter = expert_gemm._stream_scratch(first_device, ("unit_counter",), make)
    assert expert_gemm._stream_scratch(first_device, ("unit_counter",), make) is counter
    workspace = expert_gemm._stream_scratch(first_device, ("split_k", 64, 2), make)
    other_size = expert_gemm._stream_scratch(first_device, ("split_k", 128, 4), make)
    on_other_device = expert_gemm._stream_scratch(second_device, ("unit_counter",), make)
    current.cuda_stream = 2
    on_other_stream = expert_gemm._stream_scratch(first_device, ("unit_counter",), make)
    assert len(made) == 5
    assert (
        len({id(s) for s in (counter, workspace, other_size, on_other_device, on_other_stream)})
        == 5
    )


def test_inside_fresh_scratch_nothing_is_kept(monkeypatch):
    from megamoe_kernels import fresh_scratch, keeps_buffers

    monkeypatch.setattr(expert_gemm, "_current_stream_handle", lambda device: 1)
    monkeypatch.setattr(expert_gemm, "_STREAM_SCRATCH", {})
    device = torch.device("cuda", 0)
    assert keeps_buffers()
    with fresh_scratch():
        assert not keeps_buffers()
        with fresh_scratch():  # nested: still fresh, and after the inner one ends
            pass
        assert not keeps_buffers()
        first = expert_gemm._stream_scratch(device, ("unit_counter",), object)
        assert expert_gemm._stream_scratch(device, ("unit_counter",), object) is not first
    assert keeps_buffers()
    kept = expert_gemm._stream_scratch(device, ("unit_counter",), object)
    assert expert_gemm._stream_scratch(device, ("unit_counter",), object) is kept


def test_a_capturing_stream_keeps_scratch_of_its_own(monkeypatch):
    # made in the capture and kept past it (the graph's replays fill and read it), apart from
    # the eager launches' scratch of the same stream; inside fresh_scratch, made per call
    from megamoe_kernels import fresh_scratch

    capturing = SimpleNamespace(now=False)
    monkeypatch.setattr(expert_gemm, "_current_stream_handle", lambda device: 1)
    monkeypatch.setattr(expert_gemm, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing.now)
    monkeypatch.setattr(expert_gemm, "_STREAM_SCRATCH", {})
    device = torch.device("cuda", 0)
    eager = expert_gemm._stream_scratch(device, ("unit_counter",), object)
    capturing.now = True
    captured = expert_gemm._stream_scratch(device, ("unit_counter",), object)
    assert captured is not eager
    assert expert_gemm._stream_scratch(device, ("unit_counter",), object) is captured
    with fresh_scratch():
        assert expert_gemm._stream_scratch(device, ("unit_counter",), object) is not captured
    capturing.now = False
    assert expert_gemm._stream_scratch(device, ("unit_counter",), object) is eager
