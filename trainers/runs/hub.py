"""Exports shared on the Hugging Face Hub (``retr-train export``'s folders), named ``hf-hub:ORG/NAME`` (or
``hf-hub:ORG/NAME@REVISION``) wherever a run is taken, as open_clip and timm name theirs.

:func:`local_run` turns such a name into the folder of its snapshot in huggingface_hub's own cache (the ``hub``
extra), downloading it on first use; offline (``RETR_OFFLINE=1``, or huggingface_hub's ``HF_HUB_OFFLINE``) only the
cache is read, and a model not in it is the usual one line. A repository that is not a retr export is refused.
:func:`push_export` uploads an export (``retr-train push``)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from retr.common.downloads import is_offline
from retr.common.errors import MissingResourceError, UserError
from retr.common.optional import require
from retr.trainers.runs.layout import CONFIG, VOCAB, WEIGHTS

HUB_PREFIX = "hf-hub:"
#: the files of an export that loading needs (the card comes along for the user)
EXPORT_FILES = (WEIGHTS, CONFIG, VOCAB, "README.md")


def is_hub_name(run) -> bool:
    return isinstance(run, str) and run.startswith(HUB_PREFIX)


def parse_hub_name(name: str) -> tuple[str, str | None]:
    """``hf-hub:ORG/NAME[@REVISION]`` → ``(ORG/NAME, REVISION or None)``; one line when it names no repository."""
    repo, _, revision = name[len(HUB_PREFIX):].partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts):
        raise UserError(f"{name!r} names no Hub repository: write hf-hub:ORG/NAME (optionally @REVISION)")
    return repo, revision or None


def _hub():
    return require("huggingface_hub", "hub", "models on the Hugging Face Hub (hf-hub:…)")


def local_run(run: str | os.PathLike) -> Path:
    """The local folder of ``run``: the path itself, or for ``hf-hub:ORG/NAME`` its snapshot in the Hugging Face
    cache (fetched on first use unless offline), checked to be a retr export."""
    if not is_hub_name(run):
        return Path(run)
    repo, revision = parse_hub_name(str(run))
    hub = _hub()
    errors = require("huggingface_hub.errors", "hub", "models on the Hugging Face Hub (hf-hub:…)")
    offline = is_offline() or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    try:
        folder = Path(hub.snapshot_download(repo, revision=revision, allow_patterns=list(EXPORT_FILES),
                                            local_files_only=offline))
    except errors.LocalEntryNotFoundError:
        raise MissingResourceError(f"model {repo}" + (f"@{revision}" if revision else ""), hub_cache(),
                                   f"run the command on a connected machine (retr downloads {str(run)!r} into the "
                                   f"Hugging Face cache), or `hf download {repo}"
                                   + (f" --revision {revision}" if revision else "") + "`") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{run}: no such model on the Hub, or not readable with your token ({reason})") from None
    except (errors.HfHubHTTPError, OSError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{run} could not be fetched ({reason})") from None
    config = folder / CONFIG
    try:
        is_export = "export" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        is_export = False
    if not is_export or not (folder / WEIGHTS).is_file():
        raise UserError(f"{run} is not a retr model (no export's {CONFIG} and {WEIGHTS}: make one with "
                        "`retr-train export` and `retr-train push`)")
    return folder


def hub_cache() -> str:
    """huggingface_hub's cache folder (``HF_HUB_CACHE``, else ``~/.cache/huggingface/hub``)."""
    return str(require("huggingface_hub.constants", "hub", "models on the Hugging Face Hub (hf-hub:…)").HF_HUB_CACHE)


def in_hub_cache(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` lies in huggingface_hub's cache (a snapshot: nothing may be written there)."""
    try:
        cache = Path(hub_cache()).resolve()
    except UserError:                                  # the hub extra is absent: nothing came from the Hub
        return False
    return cache in Path(folder).resolve().parents


def hub_token() -> str:
    """The Hugging Face token to push with (``HF_TOKEN`` or ``hf auth login``'s), or one line saying how to get one."""
    token = _hub().get_token()
    if not token:
        raise UserError("pushing needs a Hugging Face token with write access: set HF_TOKEN or run `hf auth login`")
    return token


def push_export(folder: str | os.PathLike, repo: str, private: bool = False, token: str | None = None) -> str:
    """Upload the export ``folder`` to the model repository ``repo`` (``ORG/NAME``, created if absent); returns
    the repository's URL."""
    if is_offline():
        raise UserError(f"pushing to {repo} needs the network (RETR_OFFLINE is set)")
    parse_hub_name(HUB_PREFIX + repo)
    hub = _hub()
    token = token or hub_token()
    api = hub.HfApi(token=token)
    url = api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(repo_id=repo, repo_type="model", folder_path=str(folder),
                      allow_patterns=list(EXPORT_FILES), commit_message="Upload a retr export")
    return str(url)
