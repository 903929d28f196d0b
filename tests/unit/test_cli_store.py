"""`kiln inspect` and `kiln explain-miss` against a store: key prefixes (unique, ambiguous,
unknown), and a missing artifact told from a damaged one and from a store that cannot be
opened; each with its exit status and one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.artifact_store import Artifact, open_store
from kiln.frontend.cli.main import main

KEYS = ["ab" + "1" * 62, "ab" + "2" * 62, "cd" + "3" * 62]


@pytest.fixture
def store_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "store"
    store = open_store(root, local_cache=False)
    for key in KEYS:
        manifest = {"options": {"cpu_backend": "cpp"}, "kernels": [],
                    "inputs": [[[4, 16], [16, 1], "float32", "cpu", 0]],
                    "key_parts": {"schema": "s", "inputs": key[:8]}}
        if key.startswith("cd"):
            manifest["options"] = {"cpu_backend": "triton-interpret"}
            manifest["inputs"] = [[[8, 16], [16, 1], "float16", "cpu", 0]]
        assert store.publish(Artifact(key, manifest, {"wrapper.py": b"def call(args): pass\n"}))
    monkeypatch.setenv("KILN_STORE", str(root))
    monkeypatch.setenv("KILN_LOCAL_CACHE", "off")
    monkeypatch.setenv("KILN_STATS_FILE", "off")
    return root


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_key_prefixes(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", "cd", "--json")
    assert code == 0 and KEYS[2] in out
    code, _, err = run(capsys, "inspect", "ab")
    assert code == 2 and err.count("\n") == 1
    assert "key prefix ab is ambiguous: 2 keys start with it" in err
    code, _, err = run(capsys, "inspect", "ef")
    assert code == 1 and "no artifact with a key starting ef" in err
    code, _, err = run(capsys, "inspect", "not-hex")
    assert code == 2 and "is not a key" in err


def test_explain_miss_in_words_from_manifests(store_dir: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain-miss", "ab1", "cd")
    assert code == 0 and "inputs differs" in out
    assert "input 0: shape (4, 16) vs (8, 16); dtype 'float32' vs 'float16'" in out
    assert "option cpu_backend: 'cpp' vs 'triton-interpret'" in out


def test_missing_damaged_and_unopenable_are_told_apart(
        store_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = run(capsys, "inspect", "ef" + "0" * 62)
    assert code == 1 and "no artifact ef" in err
    blob = next(p for p in (store_dir / "cas").rglob("*") if p.is_file())
    blob.write_bytes(b"tampered")
    damaged = [run(capsys, "inspect", key)[2] for key in KEYS]  # the blob is shared
    assert all("is damaged" in err and err.count("\n") == 1 for err in damaged), damaged
    monkeypatch.setenv("KILN_STORE", "bogus://x/y")
    code, _, err = run(capsys, "inspect", KEYS[0])
    assert code == 1 and err.startswith("kiln inspect: cannot open the store")
    assert "Protocol not known: bogus" in err


def test_explain_miss_names_the_first_node_where_two_saved_graphs_differ(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two KILN_DEBUG requests whose graphs differ (a warm start that computed another
    key for one graph): explain-miss says which node, not only the graphs' sizes."""
    import torch

    from kiln.compiler.request import graph_difference
    from kiln.frontend.core.serialize import make_request

    def graph(scale: float) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(torch.ops.aten.relu.default, (x,))
        z = g.call_function(torch.ops.aten.mul.Tensor, (y, scale))
        g.output((g.call_function(torch.ops.aten.sum.default, (z,)),))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    x = torch.randn(4, 8)
    saved = []
    for i, scale in enumerate((2.0, 3.0)):
        request = make_request(graph(scale), [x], options={}, target={"kind": "cpu"})
        path = tmp_path / f"request{i}.msgpack"
        path.write_bytes(request.to_bytes())
        saved.append(request)
    monkeypatch.setenv("KILN_STATS_FILE", "off")
    code, out, _ = run(capsys, "explain-miss", str(tmp_path / "request0.msgpack"),
                       str(tmp_path / "request1.msgpack"))
    assert code == 0 and "graph differs" in out, out
    assert "graph: node 2 (call_function aten.mul.Tensor" in out and "2.0" in out \
        and "3.0" in out, out
    assert graph_difference(saved[0].graph, saved[0].graph) is None
