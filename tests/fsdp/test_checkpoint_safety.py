"""Checkpoint loading never unpickles arbitrary objects: a crafted ``.metadata`` is refused."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from raggedfsdp.checkpoint import SafeFileSystemReader, UnsafeCheckpointError, load


def test_a_genuine_checkpoint_loads(tmp_path):
    state = {"w": torch.randn(3, 4), "half": torch.ones(2, dtype=torch.bfloat16), "step": 7}
    dcp.save(state, checkpoint_id=str(tmp_path))
    target = {"w": torch.zeros(3, 4), "half": torch.zeros(2, dtype=torch.bfloat16), "step": 0}
    load(target, str(tmp_path))
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["half"], state["half"])
    assert target["step"] == 7


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_crafted_metadata_is_refused_before_running_anything(tmp_path):
    dcp.save({"w": torch.randn(2)}, checkpoint_id=str(tmp_path))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    # DCP wraps the reader's error per rank; the message names what was refused
    with pytest.raises(BaseException, match="refusing to unpickle"):  # DCP: BaseException
        load({"w": torch.zeros(2)}, str(tmp_path))
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")


def test_the_reader_itself_raises_the_named_error(tmp_path):
    dcp.save({"w": torch.randn(2)}, checkpoint_id=str(tmp_path))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(UnsafeCheckpointError):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
