"""Loading never runs remote code or unpickles weights unless asked, and never reaches the network offline."""

from __future__ import annotations

import json
import pickle
import shutil
import socket

import pytest

from snapkv_rag import ModelLoadError, SnapKVLLM
from snapkv_rag.models import loading


class _Trap:
    """Unpickling this object would create a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_remote_code_is_not_run_unless_asked(tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    marker = tmp_path / "remote-code-ran"
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "snapkv_test_custom",
                "architectures": ["XModel"],
                "auto_map": {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"},
            }
        )
    )
    code = f"open({str(marker)!r}, 'w').close()\n"
    (folder / "configuration_x.py").write_text(code)
    (folder / "modeling_x.py").write_text(code)
    with pytest.raises(ModelLoadError, match="custom"):
        SnapKVLLM(model=str(folder))
    assert not marker.exists()


def test_pickled_weights_are_never_loaded(tmp_path):
    folder = tmp_path / "pickled"
    shutil.copytree(
        loading.default_model_dir(),
        folder,
        ignore=shutil.ignore_patterns("model.safetensors", "snapkv-rag-manifest.json"),
    )
    marker = tmp_path / "unpickled"
    with open(folder / "pytorch_model.bin", "wb") as handle:
        pickle.dump(_Trap(marker), handle)
    with pytest.raises(ModelLoadError, match="pickled"):
        SnapKVLLM(model=str(folder))
    assert not marker.exists()


@pytest.fixture()
def no_network(monkeypatch):
    attempts = []

    def refuse(self, address, *args):
        attempts.append(address)
        raise OSError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


def test_hub_id_offline_fails_clearly_without_touching_the_network(monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="snapkv-test/no-such-model"):
        SnapKVLLM(model="snapkv-test/no-such-model")
    assert no_network == []


@pytest.mark.model
def test_default_model_loads_with_the_network_blocked(no_network):
    llm = SnapKVLLM()
    assert llm.generate("Say yes.", max_new_tokens=2).usage.completion_tokens >= 1
    assert no_network == []
