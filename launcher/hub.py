"""Hub model names on clusters whose compute nodes have no Internet: a `vllm.model` such as `Qwen/Qwen2.5-0.5B`
is resolved on the submit host to its snapshot folder in the HF cache (HF_HOME, which must be on a file system the
nodes mount), downloaded there once if this host can reach the hub; the job then runs on that folder, and its nodes
with HF_HUB_OFFLINE=1 (launcher.node.commands), so nothing on a node ever waits on the network."""

from __future__ import annotations

import dataclasses
import os

from launcher.core.config import ConfigError, JobConfig
from launcher.core.inputs import looks_local


def hf_home() -> str:
    return os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")


def resolve_hub_model(cfg: JobConfig, say=print, download: bool = True) -> JobConfig:
    """The config with a hub name in vllm.model replaced by its local snapshot folder (unchanged for a path).
    Cached: used as is. Not cached: downloaded into HF_HOME unless HF_HUB_OFFLINE is set (or download is False,
    as for dry-run, which then says what submit would do); else a one-line error."""
    name = cfg.vllm.model
    if looks_local(name):
        return cfg
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        path = snapshot_download(name, local_files_only=True)
    except HFValidationError:
        raise ConfigError(
            f"vllm.model {name!r} is neither a folder on this host nor a hub name (org/name); fix the path"
        ) from None
    except LocalEntryNotFoundError:  # not in the cache
        if not download and not offline:
            say(
                f"vllm.model {name}: a hub name not in HF_HOME={hf_home()} yet; submit downloads it there first "
                f"(a local folder? write it as ./{name} or an absolute path)"
            )
            return cfg
        if offline:
            raise ConfigError(
                f"vllm.model {name!r} is not in HF_HOME={hf_home()} and this host is offline; run `hf download {name}` "
                "on a host with Internet and the same HF_HOME, or use a local folder"
            ) from None
        say(f"vllm.model {name}: downloading its snapshot into HF_HOME={hf_home()} (once; the nodes will read it there)")
        try:
            path = snapshot_download(name)
        except Exception as e:
            raise ConfigError(
                f"vllm.model {name!r}: not in the cache HF_HOME={hf_home()} and the download failed "
                f"({e.__class__.__name__}: {str(e).splitlines()[0][:200]}); download it where the hub is reachable "
                f"(hf download {name}) or set vllm.model to a local model folder"
            ) from None
    say(f"vllm.model {name} -> {path} (its snapshot in HF_HOME; the nodes run offline on this folder)")
    return dataclasses.replace(cfg, vllm=dataclasses.replace(cfg.vllm, model=str(path)))
