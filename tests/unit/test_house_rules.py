"""The house's rules (README "Architecture"), read from the code itself: which wing may import which, and which one
file owns each boundary (TRL's internals, vLLM's routes, the job folder's file names). A rule broken fails here with
the file, the line and the rule; the fix is to move the name into the file that owns it, or to import it from there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def sources(folder: str) -> list[Path]:
    return sorted(p for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts)


def rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def imports(p: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, lazy ones inside functions included."""
    out = []
    for node in ast.walk(ast.parse(p.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            # `from launcher import cli` names the module launcher.cli
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if node.module in ("launcher", "trainer")]
    return out


def broken(folder: str, forbidden: re.Pattern, allowed: re.Pattern | None = None) -> list[str]:
    return [
        f"{rel(p)}:{line} imports {mod}"
        for p in sources(folder)
        for line, mod in imports(p)
        if forbidden.match(mod) and not (allowed and allowed.match(mod))
    ]


def test_launcher_core_imports_no_wing_and_no_torch():
    assert not broken(
        "launcher/core", re.compile(r"(launcher|trainer|torch|vllm|trl|transformers)\b"), re.compile(r"launcher\.core\b")
    )


def test_the_config_module_imports_nothing_of_the_house():
    """config.py is the contract's root: every other module of the core reads it, so it reads none of them."""
    config = REPO / "launcher/core/config.py"
    assert not [f"{rel(config)}:{line} imports {mod}" for line, mod in imports(config) if re.match(r"(launcher|trainer)\b", mod)]


def runtime_core_imports(p: Path) -> set[str]:
    """The launcher/core modules a core module imports at run time (those under `if TYPE_CHECKING:` are only names)."""
    tree = ast.parse(p.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("launcher.core.")}
        elif isinstance(node, ast.ImportFrom) and node.module == "launcher.core":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("launcher.core."):
            out.add(node.module.split(".")[2])  # type: ignore[union-attr]
    return out


def core_cycles() -> list[str]:
    """Import cycles among launcher/core's modules (lazy imports inside functions count: they hide a circle)."""
    graph = {p.stem: runtime_core_imports(p) for p in sources("launcher/core")}
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                cycles.append(" -> ".join([*path, nxt]))
            elif nxt not in path and nxt > path[0]:  # each cycle once, from its smallest module
                walk(nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return cycles


def test_launcher_core_has_no_import_cycle():
    assert not core_cycles()


def test_the_launcher_imports_no_torch_vllm_or_trainer():
    """The login node and the node supervisor run where torch may not even be installed."""
    assert not broken("launcher", re.compile(r"(torch|vllm|trl|transformers|accelerate|trainer)\b"))


def test_the_trainer_imports_only_the_core_of_the_launcher():
    assert not broken("trainer", re.compile(r"launcher\b"), re.compile(r"launcher\.core\b"))


def test_the_node_supervisor_and_the_login_node_stand_side_by_side():
    """launcher/node runs under srun: it reaches the login node's modules only through the core."""
    login = re.compile(r"launcher\.(cli|dryrun|submit|sweep|hub|memory|simulate|status)\b")
    assert not broken("launcher/node", login)


def test_only_trl_glue_imports_trl():
    """Any import of TRL (`import trl`, `from trl import ...`, `from trl.x import ...`, lazy ones included) outside
    trainer/trl_glue.py: the glue is where TRL's API is pinned (tests/unit/test_trl_glue.py), so it is the one importer."""
    hits = [
        h for folder in ("launcher", "trainer") for h in broken(folder, TRL_IMPORT) if not h.startswith("trainer/trl_glue.py:")
    ]
    assert not hits, "TRL imported outside trainer/trl_glue.py (add a function there and call it):\n" + "\n".join(hits)


TRL_IMPORT = re.compile(r"trl(\.|$)")
"""A module name of TRL's (trl, trl.anything), as `imports` gives it."""


def code_names(p: Path) -> list[tuple[int, str]]:
    """(line, text) of what the code itself names: string literals (f-string parts included; docstrings left out,
    prose may describe a boundary), attribute and variable names, imported modules. Comments are not in the AST."""
    tree = ast.parse(p.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    out: list[tuple[int, str]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            out.append((n.lineno, repr(n.value)))
        elif isinstance(n, ast.JoinedStr):
            out.append((n.lineno, ast.unparse(n)))
        elif isinstance(n, ast.Attribute):
            out.append((n.lineno, f".{n.attr}"))
        elif isinstance(n, ast.Name):
            out.append((n.lineno, n.id))
        elif isinstance(n, ast.ImportFrom) and n.module:
            out.append((n.lineno, n.module))
        elif isinstance(n, ast.Import):
            out += [(n.lineno, a.name) for a in n.names]
    return out


# The one exception: the node supervisor polls /health before any trainer exists, and launcher/ cannot import trainer/.
EXCEPTIONS = {("launcher/node/bootstrap.py", "'/health'")}


def grep(folders: list[str], pattern: re.Pattern, owners: set[str]) -> list[str]:
    return [
        f"{rel(p)}:{line}: {text}"
        for folder in folders
        for p in sources(folder)
        if rel(p) not in owners
        for line, text in code_names(p)
        if pattern.search(text) and (rel(p), text) not in EXCEPTIONS
    ]


# TRL's private names and internal modules the project relies on (each pinned in tests/unit/test_trl_glue.py)
TRL_INTERNALS = re.compile(
    r"trl\.(trainer|generation|extras|models)\b|grpo_trainer|VLLMGeneration|\.vllm_generation\b|_tokenize_prompts|"
    r"_get_train_sampler|_generate_single_turn|^\._step$|_move_model_to_vllm"
)

VLLM_ROUTES = re.compile(
    r"[\"'/](v1/completions|v1/models|init_weight_transfer_engine|start_weight_update|update_weights|finish_weight_update|"
    r"reset_prefix_cache|get_world_size)\b|[\"']/(pause|resume|health)\b"
)

JOB_FILES = re.compile(
    r"[\"'](plan\.json|config\.yaml|metrics\.jsonl|metrics\.lost\.jsonl|summary\.json|metrics\.png|meta\.json|job_id|"
    r"wandb_run_id|sweep\.json|job\.sbatch|checkpoints|submitit)[\"']|[\"']logs/|node\{[^}]+\}-(vllm|trainer|events)"
)


@pytest.mark.parametrize(
    "what,pattern,owners",
    [
        ("TRL internals", TRL_INTERNALS, {"trainer/trl_glue.py"}),
        ("vLLM routes", VLLM_ROUTES, {"trainer/rollout/server.py"}),
        ("job-folder file names", JOB_FILES, {"launcher/core/jobdir.py"}),
    ],
)
def test_one_file_owns_each_boundary(what, pattern, owners):
    hits = grep(["launcher", "trainer"], pattern, owners)
    assert not hits, f"{what} named outside {sorted(owners)}:\n" + "\n".join(hits)


def test_no_cross_process_record_is_told_apart_by_its_keys():
    """Rows of metrics.jsonl and node events are typed (launcher/core/records.py): no reader guesses a row's kind from
    the keys it holds or reads a checkpoint's reason by string key."""
    pattern = re.compile(r"[\"']reward[\"'] in \w+|\.get\([\"']reason[\"']\)|\[[\"']event[\"']\]")
    hits = grep(["launcher", "trainer", "bench", "gpu"], pattern, {"launcher/core/records.py"})
    assert not hits, "\n".join(hits)


def test_the_rules_see_a_violation(tmp_path):
    """Negative control: the checks find what they look for, lazy imports inside functions included."""
    f = tmp_path / "m.py"
    f.write_text(
        '"""A docstring may say /update_weights and metrics.jsonl."""\n'
        "def f(trainer, job_dir, node, client):\n"
        "    import torch\n"
        "    from launcher import cli\n"
        "    trainer._step = 3\n"
        '    client.post("/update_weights", {})\n'
        '    return job_dir / "metrics.jsonl", f"logs/node{node}-vllm.log"\n'
        "def g():\n"
        "    import trl\n"
        "    from trl import GRPOConfig\n"
        "    from trl.chat_template_utils import parse_response\n"
        "    import trlx, trl_like\n"
    )
    assert imports(f)[:3] == [(3, "torch"), (4, "launcher"), (4, "launcher.cli")]
    assert [line for line, mod in imports(f) if TRL_IMPORT.match(mod)] == [9, 10, 11]
    names = code_names(f)
    assert [line for line, t in names if TRL_INTERNALS.search(t)] == [5]
    assert [line for line, t in names if VLLM_ROUTES.search(t)] == [6]
    assert {line for line, t in names if JOB_FILES.search(t)} == {7}
    assert any("metrics.jsonl" in t for _, t in names) and any("vllm.log" in t for _, t in names if JOB_FILES.search(t))
