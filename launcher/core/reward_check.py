"""What a reward function needs, read from its source without importing it (the login node may lack the GPU stack a
reward's module imports, and importing TRL alone takes seconds): the function exists, its signature takes what TRL
passes, the dataset columns it requires (its parameters without a default that TRL does not pass itself), and the
modules it imports that are not installed here (math_verify: with the install command).

TRL calls every reward by keyword: f(prompts=, completions=, completion_ids=, trainer_state=, log_extra=, log_metric=,
**every other dataset column). A function, or a name re-exported by `from x import f`, is checked; anything else (a
callable instance, a function made by a factory) is only found here and checked when `slurm-grpo local` or the trainer
resolves it (trainer/rewards.py applies `signature_problems` to the live object)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.core.config import BUILTIN_REWARDS

BUILTIN = BUILTIN_REWARDS
"""Built-in reward names and the function each names (owned by the config, the contract's root)."""

TRL_PASSES = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
"""Keyword arguments GRPOTrainer passes every reward besides the dataset's columns (trl 1.16 `_calculate_rewards`)."""

EXTRA_OF = {"math_verify": "math", "latex2sympy2_extended": "math"}
"""Modules an extra of slurm-grpo installs (pyproject.toml [project.optional-dependencies])."""

REPO_ROOT = Path(__file__).resolve().parents[2]
"""Where launcher/ and trainer/ sit side by side (installed together): built-ins are read from there, never imported."""


@dataclass(frozen=True)
class RewardNeeds:
    columns: tuple[str, ...] = ()
    """Dataset columns the reward requires (run names, after trainer.columns)."""
    problems: tuple[str, ...] = ()
    """One line each: what would fail on the nodes."""


@dataclass(frozen=True)
class Param:
    name: str
    kind: str
    """positional-only, positional, keyword-only, *args or **kwargs."""
    required: bool


def signature_problems(entry: str, params: list[Param]) -> tuple[list[str], tuple[str, ...]]:
    """(problems, required columns) of a reward with these parameters, called as TRL calls it."""
    problems = []
    pos_only = [p.name for p in params if p.kind == "positional-only"]
    if pos_only:
        problems.append(
            f"trainer.reward_funcs {entry!r}: parameter {pos_only[0]!r} is positional-only; TRL passes every argument "
            "by keyword: f(prompts, completions, **kwargs)"
        )
    named = {p.name for p in params if p.kind in ("positional", "keyword-only")}
    if not any(p.kind == "**kwargs" for p in params):
        unaccepted = [n for n in TRL_PASSES[:-1] if n not in named]  # environments only comes with an environment
        if unaccepted:
            problems.append(
                f"trainer.reward_funcs {entry!r} takes no **kwargs, so TRL's {', '.join(unaccepted)} and every dataset "
                "column would be refused: define it as f(prompts, completions, **kwargs)"
            )
    columns = tuple(
        p.name for p in params if p.required and p.kind in ("positional", "keyword-only") and p.name not in TRL_PASSES
    )
    return problems, columns


def reward_needs(entry: str) -> RewardNeeds:
    """A config entry (a built-in name or 'pkg.module:function') checked from its source."""
    dotted = BUILTIN.get(entry, entry)
    if ":" not in dotted:
        return RewardNeeds(problems=(f"trainer.reward_funcs {entry!r}: not a built-in reward ({', '.join(BUILTIN)}) "
                                     "and not a 'pkg.module:function' path",))  # fmt: skip
    module, _, name = dotted.partition(":")
    source = source_of(module)
    if source is None:
        return RewardNeeds(problems=(
            f"trainer.reward_funcs {entry!r}: module {module!r} is not importable here; put its folder on PYTHONPATH "
            "(the job's nodes get the same) or install it into the job's venv",))  # fmt: skip
    if source.suffix != ".py":
        return RewardNeeds()  # a compiled module: found; the trainer resolves it
    try:
        found = find_def(module, source, name, depth=0)
    except Unparsable as e:  # the nodes would die importing it, after the queue and vLLM's start
        return RewardNeeds(problems=(f"trainer.reward_funcs {entry!r}: {e}; fix the file",))
    if found is None:
        return RewardNeeds(problems=(f"trainer.reward_funcs {entry!r}: module {module!r} has no function {name!r}",))
    if isinstance(found, str):  # found, but not a plain function: checked when resolved
        return RewardNeeds()
    fn, tree = found
    problems = [
        f"trainer.reward_funcs {entry!r} imports {m!r}, which is not installed here: {install_hint(m)}"
        for m in missing_imports(tree, fn)
    ]
    sig_problems, columns = signature_problems(entry, ast_params(fn))
    return RewardNeeds(columns, tuple(problems + sig_problems))


def install_hint(module: str) -> str:
    extra = EXTRA_OF.get(module)
    if extra:
        return f"pip install 'slurm-grpo[{extra}]' (from a checkout: pip install -e '.[{extra}]')"
    return "install the package that provides it into the job's venv"


def source_of(module: str) -> Path | None:
    """The file of a module, found without importing it or its parent packages (a package's __init__ may import
    torch); None if it is not there."""
    top, *rest = module.split(".")
    if top == "trainer":
        bases = [REPO_ROOT / "trainer"]
    else:
        try:
            spec = importlib.util.find_spec(top)  # a top-level name: finds, imports nothing
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        if not rest:
            return Path(spec.origin) if spec.origin and spec.origin not in ("built-in", "frozen") else Path(top)
        bases = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not rest:
        return bases[0] / "__init__.py"
    for base in bases:
        folder = base.joinpath(*rest)
        for candidate in (folder / "__init__.py", folder.with_suffix(".py")):
            if candidate.is_file():
                return candidate
        compiled = sorted(folder.parent.glob(folder.name + ".*.so"))
        if compiled:
            return compiled[0]
        if folder.is_dir():  # a namespace package
            return folder
    try:  # a module that is no file of its package (os.path): ask the import system, which imports the parents
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Module-level statements, those inside module-level if/try blocks included (conditional definitions)."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        out.append(node)
        if isinstance(node, ast.If):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + [s for h in node.handlers for s in h.body]
    return out


class Unparsable(ValueError):
    """A reward's module (or one it re-exports from) that Python cannot compile: file, line and compile()'s message."""


def parse_source(source: Path) -> ast.Module:
    """The module's tree; Unparsable naming the file, the line and the error, as importing it would fail."""
    try:
        text = source.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise Unparsable(f"{source} is unreadable ({getattr(e, 'strerror', None) or e})") from None
    try:  # compiled whole, as the import would: the parser alone misses e.g. a `return` outside a function
        compile(text, str(source), "exec", dont_inherit=True)
    except SyntaxError as e:  # IndentationError and TabError are SyntaxErrors
        line = f" line {e.lineno}" if e.lineno else ""
        here = "Python {}.{}".format(*sys.version_info[:2])  # a job whose Python is newer may accept newer syntax
        raise Unparsable(
            f"{source}{line}: {type(e).__name__}: {e.msg} (compiled by {here} here; if the job's Python is newer "
            "and accepts it: --skip-checks rewards)"
        ) from None
    except ValueError as e:  # source with a null byte
        raise Unparsable(f"{source}: {e}") from None
    return ast.parse(text)


def find_def(module: str, source: Path, name: str, depth: int):
    """(the FunctionDef, the module's tree), a string saying what else defines `name`, or None if nothing does;
    Unparsable when the module (or one it re-exports `name` from) does not compile."""
    tree = parse_source(source)
    for node in _top_level(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node, tree
        if isinstance(node, ast.ClassDef) and node.name == name:
            return "class"
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):  # a, b = ...
                return "assignment"
        if isinstance(node, ast.Import) and any((a.asname or a.name) == name for a in node.names):
            return "module"
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name == "*":
                    return "star import"
                if (a.asname or a.name) == name and depth < 4:
                    origin = _absolute(module, source, node)
                    followed = source_of(origin) if origin else None
                    if followed is None or followed.suffix != ".py":
                        return "re-export"
                    return find_def(origin, followed, a.name, depth + 1) or "re-export"  # type: ignore[arg-type]
    if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
        return "module __getattr__"
    return None


def _absolute(module: str, source: Path, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    package = module if source.name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 > len(parts) - 1:
        return None
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def missing_imports(tree: ast.Module, fn: ast.AST) -> list[str]:
    """Top-level modules the reward's module (at module level, an optional `try: import ... except ImportError` left
    out) or the function's own body imports, that are not installed here."""
    guarded: set[int] = set()  # module-level optional imports; an import inside the function is needed when it runs
    for node in _top_level(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            guarded |= {id(n) for s in node.body for n in ast.walk(s)}
    nodes = [n for n in _top_level(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    nodes += [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = []
    for n in nodes:
        if id(n) in guarded:
            continue
        if isinstance(n, ast.Import):
            names += [a.name.split(".")[0] for a in n.names]
        elif n.level == 0 and n.module:
            names.append(n.module.split(".")[0])
    missing = []
    for m in dict.fromkeys(names):
        try:
            if importlib.util.find_spec(m) is None:
                missing.append(m)
        except (ImportError, ValueError):
            missing.append(m)
    return missing


def _catches_import_error(h: ast.ExceptHandler) -> bool:
    kinds = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
    return h.type is None or any(
        isinstance(k, ast.Name) and k.id in ("ImportError", "ModuleNotFoundError", "Exception") for k in kinds
    )


def ast_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Param]:
    a = fn.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    out = [
        Param(p.arg, "positional-only" if i < len(a.posonlyargs) else "positional", i < first_default)
        for i, p in enumerate(positional)
    ]
    out += [Param(p.arg, "keyword-only", d is None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.vararg:
        out.append(Param(a.vararg.arg, "*args", False))
    if a.kwarg:
        out.append(Param(a.kwarg.arg, "**kwargs", False))
    return out
