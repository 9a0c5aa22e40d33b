"""Models on the Hugging Face Hub: ``hf-hub:ORG/NAME`` read from a cache laid out exactly as huggingface_hub lays it
out (``models--ORG--NAME/refs/main`` → ``snapshots/<commit>/``), offline, through ``retr.load_model`` and the
commands, with nothing written into the cache; the download and ``retr-train push`` up to the calls that would go
out (huggingface_hub's functions replaced by recorders); every wrong input one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from test_pipeline_wrong_inputs import assert_one_error_line
from trainer_synthetic import make_synthetic

pytest.importorskip("huggingface_hub", reason="the hub extra is not installed: pip install 'retr[hub]'")

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TINY = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--epochs", "1", "--val-images", "5",
        "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny VSE++ run, its export, and the data it was trained on."""
    from click.testing import CliRunner

    from retr.trainers.commands import cli

    folder = tmp_path_factory.mktemp("hub")
    manifest, features = make_synthetic(folder / "s", images=30, seed=0)
    for args in (["vsepp", "--features", str(features), "--manifest", str(manifest), "--out", str(folder / "run"),
                  *TINY], ["export", str(folder / "run"), "--out", str(folder / "export")]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
    return folder / "run", folder / "export", Path(manifest), Path(features)


def hub_cache(root: Path, repo: str, files: Path) -> Path:
    """``root`` as huggingface_hub's cache holding ``repo`` at :data:`COMMIT` with the files of ``files``: blobs
    by content, the snapshot's files linking to them, ``refs/main`` naming the commit. Returns the snapshot."""
    import hashlib

    base = root / f"models--{repo.replace('/', '--')}"
    snapshot = base / "snapshots" / COMMIT
    (base / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(files.iterdir()):
        blob = base / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    return root


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_hub_name_loads_from_the_cache_offline_and_writes_nothing_there(export, cache, run_cli, tmp_path):
    import retr

    run, exported, manifest, features = export
    snapshot = hub_cache(cache, "my-lab/tiny-vsepp", exported)
    before = _files(cache)
    model, vocab, config = retr.load_model("hf-hub:my-lab/tiny-vsepp")
    local, _, _ = retr.load_model(exported)
    assert config["model"] == "vsepp"
    for (name, a), (_, b) in zip(model.state_dict().items(), local.state_dict().items()):
        assert torch.equal(a, b), name
    data = ["--features", features, "--manifest", manifest, "--protocol", "f30k-1k", "--allow-size-mismatch",
            "--json", "--device", "cpu"]
    results = [json.loads(run_cli("train", "eval", name, *data).output.strip().splitlines()[-1])
               for name in ("hf-hub:my-lab/tiny-vsepp", exported, run)]
    assert [r["rsum"] for r in results[1:]] == [results[0]["rsum"]] * 2
    assert results[0]["i2t"] == results[2]["i2t"] and results[0]["t2i"] == results[2]["t2i"]
    hits = run_cli("train", "search", "hf-hub:my-lab/tiny-vsepp", "--features", features, "--manifest", manifest,
                   "--query", "a red circle", "--json", "--device", "cpu", "--quiet").output
    assert json.loads(hits.strip().splitlines()[-1])["hits"]
    assert _files(cache) == before, "nothing is written into the Hugging Face cache"
    assert snapshot.is_dir()


def test_wrong_hub_inputs_are_one_line(export, cache, run_cli, tmp_path):
    run, exported, manifest, features = export
    data = ["--features", features, "--manifest", manifest, "--protocol", "f30k-1k", "--allow-size-mismatch",
            "--device", "cpu"]

    def one_line(*argv) -> str:
        code, stdout, stderr = run_cli.as_user("train", *argv)
        assert_one_error_line(code, stdout, stderr)
        return stderr

    missing = one_line("eval", "hf-hub:my-lab/absent", *data)
    assert "model my-lab/absent not found" in missing and str(cache) in missing and "hf download my-lab/absent" in missing
    pinned = one_line("eval", "hf-hub:my-lab/absent@v1.0", *data)          # the command fetches that revision
    assert "model my-lab/absent@v1.0 not found" in pinned and "`hf download my-lab/absent --revision v1.0`" in pinned
    assert "names no Hub repository" in one_line("eval", "hf-hub:just-a-name", *data)
    # a repository that is not a retr export: a run folder's files, no export record
    hub_cache(cache, "my-lab/a-run", _plain_files(run, tmp_path / "plain"))
    assert "is not a retr model" in one_line("eval", "hf-hub:my-lab/a-run", *data)


def _plain_files(run: Path, folder: Path) -> Path:
    folder.mkdir()
    for name in ("config.json", "vocab.json"):
        shutil.copyfile(run / name, folder / name)
    return folder


def test_online_the_snapshot_is_asked_for_with_the_export_files(export, cache, monkeypatch, run_cli):
    """The call that would go out names the repository, the revision and the export's files; a command asks the
    Hub once per model (each call is a request to it when online)."""
    import huggingface_hub

    from retr.trainers.runs.hub import EXPORT_FILES, local_run

    _, exported, manifest, features = export
    monkeypatch.delenv("RETR_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    snapshot = hub_cache(cache, "my-lab/tiny-vsepp", exported)
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert local_run("hf-hub:my-lab/tiny-vsepp@v1") == snapshot
    assert calls == [("my-lab/tiny-vsepp", {"revision": "v1", "allow_patterns": list(EXPORT_FILES),
                                             "local_files_only": False})]
    calls.clear()
    run_cli("train", "eval", "hf-hub:my-lab/tiny-vsepp", "--features", features, "--manifest", manifest,
            "--protocol", "f30k-1k", "--allow-size-mismatch", "--device", "cpu", "--save-sims", cache.parent / "s.npy")
    assert [repo for repo, _ in calls] == ["my-lab/tiny-vsepp"]


class FakeApi:
    """huggingface_hub.HfApi as far as push uses it: records the calls and the files it would upload."""

    calls: list = []

    def __init__(self, token=None):
        FakeApi.calls.append(("token", token))

    def create_repo(self, repo_id, **kwargs):
        FakeApi.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, allow_patterns, **kwargs):
        files = sorted(p.name for p in Path(folder_path).iterdir() if p.name in allow_patterns)
        FakeApi.calls.append(("upload_folder", repo_id, files))


def test_push_exports_a_run_and_uploads_its_four_files(export, monkeypatch, run_cli):
    import huggingface_hub

    run, _, _, _ = export
    monkeypatch.delenv("RETR_OFFLINE", raising=False)
    FakeApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_secret")
    out = run_cli("train", "push", run, "--repo", "my-lab/tiny-vsepp", "--private").output
    assert "load it as hf-hub:my-lab/tiny-vsepp" in out
    assert FakeApi.calls == [("token", "hf_secret"),
                             ("create_repo", "my-lab/tiny-vsepp", {"repo_type": "model", "private": True,
                                                                  "exist_ok": True}),
                             ("upload_folder", "my-lab/tiny-vsepp",
                              ["README.md", "config.json", "model.safetensors", "vocab.json"])]


def test_push_without_a_token_or_offline_is_one_line_and_uploads_nothing(export, monkeypatch, run_cli):
    import huggingface_hub

    run, _, _, _ = export
    FakeApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    code, stdout, stderr = run_cli.as_user("train", "push", run, "--repo", "my-lab/x")       # RETR_OFFLINE=1
    assert_one_error_line(code, stdout, stderr)
    assert "needs the network" in stderr
    monkeypatch.delenv("RETR_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    code, stdout, stderr = run_cli.as_user("train", "push", run, "--repo", "my-lab/x")
    assert_one_error_line(code, stdout, stderr)
    assert "needs a Hugging Face token" in stderr and FakeApi.calls == []
    code, stdout, stderr = run_cli.as_user("train", "push", run, "--repo", "not-a-repo")
    assert_one_error_line(code, stdout, stderr)
    assert "names no Hub repository" in stderr
