"""Checks each node runs before it starts anything (torch-free): the model folder and the dataset are
readable there. A missing model or a malformed data line then fails in seconds, naming the node and the
file, instead of after a minute of vLLM start-up or inside a torchrun traceback.

`submit_path_problems` runs the same checks on the submit host before sbatch (plus: reward, tool, environment and
rollout_func modules importable, the setup venv present), so a typo fails at once instead of after the job waited in the queue. `local_problems` runs
them before `slurm-grpo local` starts anything, and resolves the rewards, tools, environments and rollout_func as the trainer will (this host runs it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from launcher.core.config import JobConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


class PreflightError(ValueError):
    pass


def looks_local(model: str) -> bool:
    """A hub name is `org/name` (or `name`); anything absolute, relative-dotted or home-based is a path."""
    return model.startswith(("/", "./", "../", "~")) or Path(model).expanduser().exists()


def check_model(model: str) -> None:
    if not looks_local(model):
        return  # a hub name: vLLM and transformers resolve it (from the node's HF cache when offline)
    p = Path(model).expanduser()
    if not p.is_dir():
        raise PreflightError(
            f"vllm.model {model!r}: no such folder on this node (model folders must be on a "
            f"file system every node mounts; build a test one with `slurm-grpo make-tiny-model DIR`)"
        )
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config.json")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        missing.append("a tokenizer (tokenizer.json or tokenizer_config.json)")
    if not any(any(p.glob(g)) for g in WEIGHT_GLOBS):
        missing.append("weights (*.safetensors)")
    if missing:
        raise PreflightError(f"vllm.model {model!r} is not a complete model folder: missing {', '.join(missing)}")
    try:
        json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise PreflightError(f"vllm.model {model!r}: config.json is unreadable ({e})") from None


def read_jsonl_prompts(path: str) -> list[dict]:
    """Every non-empty line a JSON object with a 'prompt'; the error names the file and the line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise PreflightError(f"trainer.dataset {path!r} is unreadable: {e.strerror}") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise PreflightError(f"trainer.dataset {path}: line {i} is not valid JSON ({e}); fix or remove that line") from None
        if not isinstance(row, dict) or "prompt" not in row:
            raise PreflightError(
                f'trainer.dataset {path}: line {i} has no \'prompt\' field; each line must be an object like {{"prompt": "..."}}'
            )
        rows.append(row)
    if not rows:
        raise PreflightError(f"trainer.dataset {path} is empty")
    return rows


def check_dataset(path: str) -> None:
    p = Path(path)
    if not p.exists():
        raise PreflightError(
            f"trainer.dataset {path!r} does not exist on this node (paths are read on the nodes; "
            f"use an absolute path on a shared file system)"
        )
    if p.is_dir():
        if not any((p / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            raise PreflightError(f"trainer.dataset {path!r} is a folder but not one saved by `datasets` (no dataset_info.json)")
    elif p.suffix in (".jsonl", ".json"):
        read_jsonl_prompts(path)
    elif p.suffix != ".parquet":
        raise PreflightError(f"trainer.dataset {path!r}: unknown format; use .jsonl, .parquet or a `datasets` folder")


def check_context_length(config: JobConfig) -> None:
    """vLLM refuses to start with a max_model_len above the model's own context (found only after its imports, minutes
    in on a GPU): compared here with config.json's max_position_embeddings, for a model folder on this host."""
    want, model = config.vllm.max_model_len, config.vllm.model
    cfg_file = Path(model).expanduser() / "config.json"
    if not want or not looks_local(model) or not cfg_file.is_file():
        return
    try:
        own = json.loads(cfg_file.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return  # check_model names an unreadable config.json
    if isinstance(own, int) and want > own:
        raise PreflightError(
            f"vllm.max_model_len ({want}) is above the model's max_position_embeddings ({own}) in {cfg_file}; vLLM would "
            f"refuse to start: set vllm.max_model_len={own} or lower (0 = the model's own)"
        )


def check_eval_dataset(config: JobConfig) -> None:
    """trainer.eval.dataset, when set: the same checks as trainer.dataset, the error naming its own key."""
    path = config.trainer.eval.dataset
    if not path:
        return
    try:
        check_dataset(path)
    except PreflightError as e:
        raise PreflightError(str(e).replace("trainer.dataset", "trainer.eval.dataset", 1)) from None


def check_node_inputs(config: JobConfig) -> None:
    check_model(config.vllm.model)
    check_context_length(config)
    check_dataset(config.trainer.dataset)
    check_eval_dataset(config)


SKIP_HINT = "if these paths exist only on the compute nodes, submit again with --skip-path-checks"


def reward_module_problem(entry: str) -> str | None:
    """A 'pkg.module:function' reward whose module cannot be found from here (found, not run: its imports may need
    the GPU stack this host lacks). Built-in names are the trainer's and were checked by the config."""
    if ":" not in entry:
        return None
    module = entry.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing
        found = False
    if found:
        return None
    return (
        f"trainer.reward_funcs {entry!r}: module {module!r} is not importable here; put its folder on PYTHONPATH "
        f"(the job's nodes get the same) or install it into the job's venv"
    )


def input_problems(config: JobConfig) -> list[str]:
    """The nodes' own checks (model folder, dataset), run on this host: each a one-line error."""
    problems = []
    checks = (
        lambda: check_model(config.vllm.model),
        lambda: check_context_length(config),
        lambda: check_dataset(config.trainer.dataset),
        lambda: check_eval_dataset(config),
    )
    for check in checks:
        try:
            check()
        except PreflightError as e:
            problems.append(str(e).replace(" on this node", " on this host"))
    return problems


def submit_path_problems(config: JobConfig) -> list[str]:
    """What the nodes would find missing, checked on the submit host: each a one-line error."""
    problems = input_problems(config)
    problems += [p for p in map(reward_module_problem, config.trainer.reward_funcs) if p]
    problems += [
        p.replace("trainer.reward_funcs", "trainer.eval.reward_funcs", 1)
        for p in map(reward_module_problem, config.trainer.eval.reward_funcs)
        if p
    ]
    problems += agent_module_problems(config)
    venv = config.slurm.setup_vars.get("venv", "")
    if venv and not (Path(venv).expanduser() / "bin" / "activate").is_file():
        problems.append(
            f"slurm.setup_vars.venv {venv!r}: no bin/activate there; create it (python -m venv {venv}) or fix the path"
        )
    return problems


REWARD_CHECK_TIMEOUT_S = 300


def reward_import_problems(entries: list[str], python: str = sys.executable) -> list[str]:
    """The 'pkg.module:function' rewards resolved exactly as this host's trainer ranks will (trainer.rewards, in a
    child of the ranks' interpreter, cwd and environment: the modules' own imports stay out of the launcher), so a
    module that cannot be imported or lacks the function fails before vLLM starts. Each problem one line."""
    dotted = [e for e in entries if ":" in e]
    if not dotted:
        return []
    return _child_problems([python, "-m", "trainer.rewards", *dotted], f"trainer.reward_funcs {dotted}")


def _child_problems(argv: list[str], what: str) -> list[str]:
    """Run a trainer-side checker (its last stdout line: a JSON list of one-line problems) and return its problems."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=REWARD_CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return [f"{what}: importing them took over {REWARD_CHECK_TIMEOUT_S} s here; fix the module's imports"]
    lines = r.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else None
    except ValueError:
        found = None
    if isinstance(found, list) and (found or r.returncode == 0):
        return [str(x) for x in found]
    last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    return [f"{what}: checking them with `{' '.join(argv[:3])}` failed (exit {r.returncode}: {last})"]


def local_problems(config: JobConfig, python: str = sys.executable) -> list[str]:
    """What `slurm-grpo local` would find only after vLLM started: the nodes' checks, run here, and the rewards
    resolved as the trainer will. (No venv check: local runs in this interpreter.)"""
    return (
        input_problems(config)
        + reward_import_problems(config.trainer.reward_funcs, python)
        + reward_import_problems(config.trainer.eval.reward_funcs, python)
        + agent_import_problems(config, python)
    )


def agent_entries(config: JobConfig) -> list[tuple[str, str]]:
    """(config key, 'pkg.module:name') of every tool, environment factory and rollout_func."""
    t = config.trainer
    out = [("trainer.tools", e) for e in t.tools]
    if isinstance(t.environment, dict):
        out += [(f"trainer.environment.{n}", e) for n, e in t.environment.items()]
    elif t.environment:
        out.append(("trainer.environment", t.environment))
    if t.rollout_func:
        out.append(("trainer.rollout_func", t.rollout_func))
    return out


def agent_module_problems(config: JobConfig) -> list[str]:
    """Each tool, environment or rollout_func whose module cannot be found from the submit host (found, not run)."""
    out = []
    for key, entry in agent_entries(config):
        problem = reward_module_problem(entry)
        if problem:
            out.append(problem.replace("trainer.reward_funcs", key, 1))
    return out


def agent_import_problems(config: JobConfig, python: str = sys.executable) -> list[str]:
    """Tools, environments and rollout_func resolved exactly as this host's trainer ranks will (trainer.agents.resolve
    in a child, as for the rewards): importable, the right kind of object, tools the model can be told about."""
    t = config.trainer
    if not t.multi_turn:
        return []
    envs = (
        [f"{n}={e}" for n, e in t.environment.items()]
        if isinstance(t.environment, dict)
        else [t.environment] * bool(t.environment)
    )
    argv = [python, "-m", "trainer.agents.resolve"]
    argv += [x for e in t.tools for x in ("--tool", e)] + [x for e in envs for x in ("--environment", e)]
    argv += ["--rollout-func", t.rollout_func] if t.rollout_func else []
    return _child_problems(argv, "trainer.tools/environment/rollout_func")
