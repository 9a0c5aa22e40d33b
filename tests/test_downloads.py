"""Downloads (retr.common.downloads) against a local HTTP server with Range support: resume, integrity checks,
failures, offline mode without a socket, progress lines, and weights checked before they are kept."""
from __future__ import annotations

import hashlib
import io
import socket
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from retr.common import downloads
from retr.common.downloads import SOURCES, download, partial_path, unpack_zip
from retr.common.errors import MissingResourceError, UserError
from tests.local_server import LocalServer

DATA = bytes(range(256)) * 12_000          # 3,072,000 bytes
SHA256 = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def online(monkeypatch):
    """This test serves its own files: leave the suite's offline mode, retry at once."""
    monkeypatch.setenv("RETR_OFFLINE", "0")
    monkeypatch.setenv("RETR_MIRROR", "")     # recorded, so a --mirror a command sets is undone afterwards
    monkeypatch.delenv("RETR_MIRROR")
    monkeypatch.setattr(downloads, "DEFAULT_RETRY_WAIT", 0.0)


@pytest.fixture
def server(online):
    with LocalServer() as running:
        running.files["/data.bin"] = DATA
        yield running


@pytest.fixture
def no_sockets(monkeypatch):
    """Every attempt to open a socket is recorded and refused."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a socket was opened")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return calls


def leftovers(folder: Path) -> list[str]:
    """Files in ``folder`` other than the lock files the downloader keeps."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


# ---------------------------------------------------------------------------------------------- resume

def test_an_interrupted_download_keeps_its_partial_file_and_the_next_run_resumes(server, tmp_path):
    server.cut["/data.bin"] = [1_000_000]
    dest = tmp_path / "data.bin"
    with pytest.raises(UserError) as caught:
        download(f"{server.url}/data.bin", dest, sha256=SHA256, retries=0, quiet=True)
    message = str(caught.value)
    assert "\n" not in message and "next run resumes" in message and str(partial_path(dest)) in message
    assert leftovers(tmp_path) == ["data.bin.partial"] and partial_path(dest).stat().st_size == 1_000_000
    assert download(f"{server.url}/data.bin", dest, sha256=SHA256, retries=0, quiet=True) == dest
    assert dest.read_bytes() == DATA and leftovers(tmp_path) == ["data.bin"]
    assert server.requests == [("/data.bin", None), ("/data.bin", "bytes=1000000-")]
    # complete: the next call opens no connection
    assert download(f"{server.url}/data.bin", dest, sha256=SHA256) == dest and len(server.requests) == 2


def test_drops_within_the_retries_are_resumed_in_the_same_call(server, tmp_path):
    server.cut["/data.bin"] = [500_000, 700_000]
    server.fail["/data.bin"] = [503]
    dest = download(f"{server.url}/data.bin", tmp_path / "data.bin", size=len(DATA), sha256=SHA256, quiet=True)
    assert dest.read_bytes() == DATA
    assert [r for _, r in server.requests] == [None, None, "bytes=500000-", "bytes=1200000-"]


def test_a_server_that_ignores_the_range_sends_the_whole_file_again(server, tmp_path):
    dest = tmp_path / "data.bin"
    partial_path(dest).write_bytes(b"x" * 1000)          # not even the file's first bytes
    server.ignore_range.add("/data.bin")
    download(f"{server.url}/data.bin", dest, sha256=SHA256, quiet=True)
    assert dest.read_bytes() == DATA and server.requests == [("/data.bin", "bytes=1000-")]


def test_a_complete_partial_file_is_finished_without_its_bytes_again(server, tmp_path):
    dest = tmp_path / "data.bin"
    partial_path(dest).write_bytes(DATA)
    download(f"{server.url}/data.bin", dest, sha256=SHA256, quiet=True)      # 416 from the server: nothing left
    assert dest.read_bytes() == DATA and server.requests == [("/data.bin", f"bytes={len(DATA)}-")]


# ---------------------------------------------------------------------------------------------- checks

@pytest.mark.parametrize("check", [{"sha256": "0" * 64}, {"md5": "0" * 32}])
def test_a_checksum_mismatch_is_refused_and_leaves_no_file(server, tmp_path, check):
    dest = tmp_path / "data.bin"
    with pytest.raises(UserError) as caught:
        download(f"{server.url}/data.bin", dest, quiet=True, **check)
    message = str(caught.value)
    name = next(iter(check))
    assert "\n" not in message and f"fails its {name} check" in message and "removed" in message
    assert leftovers(tmp_path) == []


def test_the_right_md5_passes(server, tmp_path):
    dest = download(f"{server.url}/data.bin", tmp_path / "d", md5=hashlib.md5(DATA).hexdigest(), quiet=True)
    assert dest.read_bytes() == DATA


def test_a_file_of_another_size_than_the_known_one_is_refused(server, tmp_path):
    with pytest.raises(UserError, match=r"is 3,072,000 bytes, not the 3,072,001 bytes of .*removed") as caught:
        download(f"{server.url}/data.bin", tmp_path / "data.bin", size=len(DATA) + 1, quiet=True)
    assert "\n" not in str(caught.value) and leftovers(tmp_path) == []


def test_a_404_is_one_line_and_leaves_nothing(server, tmp_path):
    with pytest.raises(UserError) as caught:
        download(f"{server.url}/missing.bin", tmp_path / "missing.bin", quiet=True)
    assert str(caught.value) == f"download of {server.url}/missing.bin failed: HTTP 404 Not Found"
    assert leftovers(tmp_path) == []


def test_a_destination_under_a_file_is_one_line_before_any_request(server, tmp_path):
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    with pytest.raises(UserError, match=r"^cannot download into .*cache/weights: it, or a folder above it, is a file$"):
        download(f"{server.url}/data.bin", tmp_path / "cache" / "weights" / "data.bin", sha256=SHA256, quiet=True)
    assert server.requests == []


def test_an_unreachable_server_fails_in_one_line_after_the_retries(online, tmp_path):
    with LocalServer() as gone:
        url = f"{gone.url}/x.bin"
    with pytest.raises(UserError) as caught:
        download(url, tmp_path / "x.bin", retries=2, quiet=True)
    message = str(caught.value)
    assert "\n" not in message and "failed after 3 failed attempts" in message and "nothing was received" in message
    assert leftovers(tmp_path) == []


def test_a_validator_refuses_the_file_before_the_rename(server, tmp_path):
    def refuse(path: Path) -> None:
        assert path.name == "data.bin.partial" and path.read_bytes() == DATA
        raise UserError("not loadable")

    with pytest.raises(UserError, match=r"data.bin downloaded from .* was refused: not loadable; removed it"):
        download(f"{server.url}/data.bin", tmp_path / "data.bin", validate=refuse, quiet=True)
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------- offline

def test_offline_opens_no_socket_and_names_the_command(monkeypatch, tmp_path, no_sockets):
    monkeypatch.setenv("RETR_OFFLINE", "1")
    with pytest.raises(MissingResourceError) as caught:
        download("http://example.org/x.bin", tmp_path / "x.bin", what="the x file", how="run fetch-x")
    assert str(caught.value) == f"the x file not found (looked in {tmp_path / 'x.bin'}); run fetch-x"
    assert no_sockets == [] and leftovers(tmp_path) == []
    (tmp_path / "x.bin").write_bytes(b"there")            # a complete file needs no network either
    assert download("http://example.org/x.bin", tmp_path / "x.bin") == tmp_path / "x.bin" and no_sockets == []


def test_every_fetching_command_offline_is_one_line_without_a_socket(monkeypatch, tmp_path, no_sockets, run_cli):
    for name, value in {"TORCH_HOME": tmp_path / "torch", "HF_HOME": tmp_path / "hf", "HOME": tmp_path / "home",
                        "STANZA_RESOURCES_DIR": tmp_path / "stanza", "RETR_DATA": tmp_path / "data"}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("RETR_WEIGHTS", raising=False)
    monkeypatch.delenv("RETR_BUTD_WEIGHTS", raising=False)
    monkeypatch.setenv("RETR_OFFLINE", "0")              # --offline must do it on its own
    for argv, expected in [
            (["fetch-weights", "--offline"], "error: weights resnet152, vgg16, vgg19, inception_resnet_v2, butd, "
                                             "stanza not found (looked in "),
            (["fetch-data", "coco", "--root", tmp_path / "coco", "--offline"],
             "error: Karpathy's split file dataset_coco.json (in caption_datasets.zip) not found"),
            (["extract-preset", "coco", "--offline"], "error: the coco dataset (manifest manifest.jsonl) not found"),
            (["extract-preset", "f30k", "--offline"], "run retr-pipeline fetch-data f30k --images-zip FILE")]:
        monkeypatch.setenv("RETR_OFFLINE", "0")
        code, stdout, stderr = run_cli.as_user("pipeline", *argv)
        assert code == 1 and stdout == "" and stderr.count("\n") == 1, stderr
        assert expected in stderr and "fetch-" in stderr, stderr
    assert no_sockets == []


# ---------------------------------------------------------------------------------------------- progress

def test_progress_is_whole_lines_when_stderr_is_not_a_terminal(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RETR_PROGRESS_SECONDS", "0")
    download(f"{server.url}/data.bin", tmp_path / "data.bin")
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and lines and all(line.startswith("data.bin:") for line in lines), err
    assert "100%" in lines[-1] and "3.07M" in lines[-1]


def test_quiet_prints_nothing(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RETR_PROGRESS_SECONDS", "0")
    download(f"{server.url}/data.bin", tmp_path / "data.bin", quiet=True)
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------- weights

def _butd_state(rename: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the detector in the MILVLG layout, as zeros that share one element (a tiny file)."""
    from retr.extractors.butd.model import BottomUpAttention

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in BottomUpAttention().state_dict().items()}
    one = torch.zeros(1)
    state = {k: one.expand(shape) for k, shape in shapes.items()}
    if rename:
        state["roi_heads.box_predictor.cls_scores.weight"] = state.pop("roi_heads.box_predictor.cls_score.weight")
    return state


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_the_butd_checkpoint_is_checked_for_size_and_loadability_and_its_sha256_recorded(server, tmp_path,
                                                                                       monkeypatch):
    from retr.extractors.base import build_extractor
    from retr.extractors.butd.checkpoint import fetch_checkpoint

    name = SOURCES["butd"].filename
    good = _saved({"model": _butd_state(), "__author__": "test"})
    dest = tmp_path / "w" / name
    monkeypatch.setattr(downloads, "DEFAULT_RETRIES", 0)
    # cut short: the partial file stays, nothing under the final name
    server.files[f"/{name}"] = good
    server.cut[f"/{name}"] = [len(good) // 2]
    with pytest.raises(UserError, match="next run resumes"):
        fetch_checkpoint(dest, quiet=True, mirror=server.url + "/")
    assert not dest.exists() and partial_path(dest).stat().st_size == len(good) // 2
    # damaged on the server (the bytes of a cut file, announced as complete): refused, nothing left
    server.files[f"/{name}"] = good[: len(good) // 2]
    partial_path(dest).unlink()
    with pytest.raises(UserError) as caught:
        fetch_checkpoint(dest, quiet=True, mirror=server.url)
    assert "was refused: cannot read" in str(caught.value) and "removed it" in str(caught.value)
    assert "\n" not in str(caught.value) and leftovers(dest.parent) == []
    # a loadable file of another layout: refused by the key check
    server.files[f"/{name}"] = _saved({"model": _butd_state(rename=True)})
    with pytest.raises(UserError, match=r"was refused: .* does not match the detector: .*1 missing .*1 unexpected"):
        fetch_checkpoint(dest, quiet=True, mirror=server.url)
    assert leftovers(dest.parent) == []
    # the real thing (arrays instead of tensors, as detectron2-era files hold, load too)
    import numpy as np
    server.files[f"/{name}"] = good
    assert fetch_checkpoint(dest, quiet=True, mirror=server.url) == dest and dest.read_bytes() == good
    assert leftovers(dest.parent) == [name]
    # first use: the extractor finds (or would fetch) it in RETR_WEIGHTS and records the file's sha256
    monkeypatch.setenv("RETR_WEIGHTS", str(dest.parent))
    monkeypatch.delenv("RETR_BUTD_WEIGHTS", raising=False)
    extractor = build_extractor("butd-regions", short_side=64, max_side=64, post_nms_topk=36, pooled_size=7)
    assert extractor.attrs()["weights"] == f"{name} sha256:{hashlib.sha256(good).hexdigest()}"
    arrays = {k: np.zeros(v.shape, np.float32) for k, v in list(_butd_state().items())[:3]}
    (tmp_path / "arrays.pth").write_bytes(_saved({"model": arrays}))
    from retr.extractors.butd.checkpoint import read_pth
    assert set(read_pth(tmp_path / "arrays.pth")) == set(arrays)


def test_the_butd_checkpoint_is_fetched_on_first_use(server, tmp_path, monkeypatch):
    from retr.extractors.butd.extractor import resolve_default_checkpoint

    name = SOURCES["butd"].filename
    server.files[f"/{name}"] = _saved({"model": _butd_state()})
    monkeypatch.setenv("RETR_WEIGHTS", str(tmp_path / "w"))
    monkeypatch.setenv("RETR_MIRROR", server.url)
    monkeypatch.delenv("RETR_BUTD_WEIGHTS", raising=False)
    assert resolve_default_checkpoint(quiet=True) == str(tmp_path / "w" / name)
    monkeypatch.setenv("RETR_OFFLINE", "1")
    monkeypatch.setenv("RETR_WEIGHTS", str(tmp_path / "elsewhere"))
    with pytest.raises(MissingResourceError, match="run retr-pipeline fetch-weights butd on a connected machine"):
        resolve_default_checkpoint()


def test_torchvision_weights_download_through_torchvisions_loader(online, tmp_path, monkeypatch):
    """Not cached: torchvision's own loader (hash checked) fills the cache; offline: one line naming the command."""
    import torchvision.models._api as api

    from retr.extractors.weights import fetch_imagenet_weights

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    calls = []

    def fake_loader(url, *args, **kwargs):
        calls.append((url, kwargs))
        path = tmp_path / "torch" / "hub" / "checkpoints" / url.rsplit("/", 1)[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"weights")
        return {}

    monkeypatch.setattr(api, "load_state_dict_from_url", fake_loader)
    path = fetch_imagenet_weights("vgg16", quiet=True)
    assert path == tmp_path / "torch" / "hub" / "checkpoints" / "vgg16-397923af.pth" and path.is_file()
    assert calls == [(SOURCES["vgg16"].url, {"progress": False, "check_hash": True})]
    assert fetch_imagenet_weights("vgg16") == path and len(calls) == 1          # cached: no second call
    monkeypatch.setenv("RETR_OFFLINE", "1")
    with pytest.raises(MissingResourceError) as caught:
        fetch_imagenet_weights("vgg19")
    assert "run retr-pipeline fetch-weights vgg19 on a connected machine" in str(caught.value) and len(calls) == 1


def test_torchvision_weights_from_a_mirror_are_checked_against_the_known_size(server, tmp_path, monkeypatch):
    from retr.extractors.weights import fetch_imagenet_weights

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    server.files["/vgg16-397923af.pth"] = b"not the weights"
    with pytest.raises(UserError, match=r"is 15 bytes, not the 553,433,881 bytes of ImageNet weights"):
        fetch_imagenet_weights("vgg16", quiet=True, mirror=server.url)
    assert leftovers(tmp_path / "torch" / "hub" / "checkpoints") == []


def test_the_fetch_weights_command_downloads_from_a_mirror_and_reports_a_404_in_one_line(server, tmp_path,
                                                                                        monkeypatch, run_cli):
    monkeypatch.setenv("RETR_WEIGHTS", str(tmp_path / "w"))
    monkeypatch.delenv("RETR_BUTD_WEIGHTS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    code, stdout, stderr = run_cli.as_user("pipeline", "fetch-weights", "butd-regions", "--mirror", server.url,
                                           "--quiet")
    assert code == 1 and stdout == ""
    assert stderr == (f"error: download of {server.url}/bua-caffe-frcn-r101-k36.pth failed: HTTP 404 Not Found\n")
    server.files["/bua-caffe-frcn-r101-k36.pth"] = _saved({"model": _butd_state()})
    code, stdout, stderr = run_cli.as_user("pipeline", "fetch-weights", "butd", "--mirror", server.url, "--quiet")
    assert (code, stderr) == (0, "") and stdout == f"butd: {tmp_path / 'w' / 'bua-caffe-frcn-r101-k36.pth'} (downloaded)\n"
    code, stdout, _ = run_cli.as_user("pipeline", "fetch-weights", "butd", "--offline")
    assert code == 0 and stdout.endswith("(already there)\n")


# ---------------------------------------------------------------------------------------------- archives, disk, table

def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, body in members.items():
            archive.writestr(name, body)
    return buffer.getvalue()


def test_unpacking_checks_every_members_crc_and_resumes(tmp_path):
    archive = tmp_path / "a.zip"
    archive.write_bytes(_zip({"d/one.txt": b"first member", "d/two.txt": b"second member", "../evil.txt": b"x"}))
    summary = unpack_zip(archive, tmp_path / "out", quiet=True)
    assert (summary.written, summary.skipped) == (2, 1) and not (tmp_path / "evil.txt").exists()
    assert (tmp_path / "out" / "d" / "two.txt").read_bytes() == b"second member"
    (tmp_path / "out" / "d" / "two.txt").unlink()
    again = unpack_zip(archive, tmp_path / "out", quiet=True)                   # an interrupted unpack resumes
    assert (again.written, again.present) == (1, 1)
    damaged = tmp_path / "damaged.zip"
    damaged.write_bytes(archive.read_bytes().replace(b"second member", b"SECOND member"))
    with pytest.raises(UserError) as caught:
        unpack_zip(damaged, tmp_path / "out2", quiet=True)
    message = str(caught.value)
    assert "\n" not in message and "member d/two.txt fails its check" in message and "Bad CRC-32" in message
    assert not damaged.exists() and "removed" in message                        # downloaded: fetched again next run
    assert sorted(p.name for p in (tmp_path / "out2" / "d").iterdir()) == ["one.txt"]   # no .partial left


def test_too_little_free_disk_is_one_line(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 5_000_000, 5_000_000))
    with pytest.raises(UserError, match=r"^not enough free disk space in .*: fetching x needs 20.2 GB, 5.0 MB free"):
        downloads.ensure_free_space(tmp_path / "new" / "folder", 20_200_000_000, "fetching x")


def test_the_table_agrees_with_torchvision_and_holds_well_formed_entries():
    import torchvision.models as tvm

    for key, arch in (("resnet152", "resnet152"), ("vgg16", "vgg16"), ("vgg19", "vgg19")):
        member = tvm.get_model_weights(arch)["IMAGENET1K_V1"]
        assert SOURCES[key].url == member.url and SOURCES[key].filename == member.url.rsplit("/", 1)[1]
        if SOURCES[key].sha256:
            prefix = SOURCES[key].filename.rsplit("-", 1)[1].split(".")[0]
            assert SOURCES[key].sha256.startswith(prefix)
    for source in SOURCES.values():
        assert source.sha256 is None or len(source.sha256) == 64 and int(source.sha256, 16) >= 0
        assert source.download_bytes > 0 and source.url.startswith("https://") or source.url.startswith("http://")
    assert len({s.filename for s in SOURCES.values()}) == len(SOURCES)
    assert SOURCES["coco-train2014"].url_for("http://m.example/x/") == "http://m.example/x/train2014.zip"
    assert replace(SOURCES["vgg16"], size=None).download_bytes == 0
