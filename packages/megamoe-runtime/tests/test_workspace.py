"""Symmetric-workspace sizing rules that need no GPU: heap size parsing and the error that says
which variable to raise."""

from __future__ import annotations

import pytest
import torch
from megamoe_runtime.workspace import SymmetricWorkspace, symmetric_heap_bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", 1 << 30), ("4G", 4 << 30), ("512M", 512 << 20), ("2gb", 2 << 30), ("1048576", 1 << 20)],
)
def test_heap_size_follows_nvshmem_symmetric_size(monkeypatch, value, expected):
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", value)
    assert symmetric_heap_bytes() == expected


def test_malformed_heap_size_is_named(monkeypatch):
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "lots")
    with pytest.raises(ValueError, match="NVSHMEM_SYMMETRIC_SIZE='lots'"):
        symmetric_heap_bytes()


def test_request_beyond_the_heap_names_the_variable(monkeypatch):
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "64M")
    workspace = SymmetricWorkspace(
        process_group=None, device=torch.device("cuda", 0), rank=0, world_size=2
    )
    with pytest.raises(MemoryError, match="raise NVSHMEM_SYMMETRIC_SIZE"):
        workspace.buffer("ep.rows", (8192, 7168), torch.bfloat16)
