"""Multi-turn agents, unit tier: the config keys (trainer.tools, trainer.environment, trainer.rollout_func,
trainer.tool_timeout_s), their resolution with one line per problem (trainer.agents.resolve, which `slurm-grpo local`
runs in a child before anything starts), the deadline on every tool call, the turn count, and the tool-calling tiny
model's chain through transformers and TRL's own parser (no server)."""

from __future__ import annotations

import asyncio
import inspect
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from launcher.core import config as C
from launcher.core.config import ConfigError
from launcher.core.inputs import agent_import_problems, agent_module_problems, submit_path_problems
from tests.conftest import REPO, cli
from tests.support.fakes import clean_env, fake_vllm, port_sets
from trainer.agents import deadline, figures, resolve

BASE = {"vllm": {"model": "/models/m"}, "slurm": {"gpus_per_node": 4}}


def load(trainer: dict, sets: list[str] | None = None, tmp_path: Path | None = None) -> C.JobConfig:
    f = (tmp_path or Path("/tmp")) / f"agents-{abs(hash(repr(trainer)))}.yaml"
    f.write_text(yaml.safe_dump({**BASE, "trainer": trainer}))
    return C.load(f, sets or [])


# ----------------------------------------------------------------------------- config


def test_the_keys_parse_one_environment_or_a_mapping_from_yaml_and_set(tmp_path):
    cfg = load({"tools": ["a.b:c"], "environment": "m.env:Make", "grpo": {"max_tool_calling_iterations": 3}}, tmp_path=tmp_path)
    t = cfg.trainer
    assert (t.tools, t.environment, t.rollout_func, t.multi_turn) == (["a.b:c"], "m.env:Make", "", True)
    assert t.grpo == {"max_tool_calling_iterations": 3}
    t = load({"environment": {"math": "m.env:Math", "game": "m.env:Game"}, "reward_funcs": []}, tmp_path=tmp_path).trainer
    assert t.environment == {"math": "m.env:Math", "game": "m.env:Game"} and t.reward_funcs == []
    t = load({}, ["trainer.environment={math: m.env:Math}", "trainer.tool_timeout_s=5"], tmp_path).trainer
    assert t.environment == {"math": "m.env:Math"} and t.tool_timeout_s == 5.0
    t = load({}, ["trainer.rollout_func=m.roll:episodes"], tmp_path).trainer
    assert t.rollout_func == "m.roll:episodes" and t.multi_turn
    assert not load({}, tmp_path=tmp_path).trainer.multi_turn


BAD = [
    ({"tools": ["not a path"]}, "trainer.tools entry 'not a path' is not a dotted path"),
    ({"environment": "nocolon"}, "trainer.environment 'nocolon' is not a dotted path"),
    ({"environment": {"math": "m:"}}, "trainer.environment.math 'm:' is not a dotted path"),
    ({"environment": {}}, "trainer.environment is an empty mapping"),
    ({"environment": ["m.e:E"]}, "trainer.environment must be a string or a mapping (key: value), got"),
    ({"rollout_func": "m:f", "tools": ["m:t"]}, "trainer.rollout_func runs your own episode loop"),
    ({"tools": ["m:t"], "tool_timeout_s": 0}, "trainer.tool_timeout_s must be positive"),
    ({"rollout_func": "m:f", "max_staleness": 1}, "trainer.max_staleness (1) with a rollout_func is not supported"),
    ({"reward_funcs": []}, "trainer.reward_funcs is empty"),
]


@pytest.mark.parametrize("trainer, needle", BAD, ids=[b[1][:40] for b in BAD])
def test_a_bad_agent_key_is_one_line_with_the_fix(tmp_path, trainer, needle):
    with pytest.raises(ConfigError) as e:
        load(trainer, tmp_path=tmp_path)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- resolution

MODULE = '''
import time


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def undocumented(a, b):
    return a + b


class Calc:
    """An environment."""

    def reset(self, **row):
        self.n = 0

    def mul(self, a: int, b: int) -> int:
        """Multiplies.

        Args:
            a: The first.
            b: The second.
        """
        self.n += 1
        return a * b

    def slow(self, s: float) -> str:
        """Sleeps.

        Args:
            s: Seconds.
        """
        time.sleep(s)
        return "woke"

    def get_reward(self) -> float:
        return float(self.n)


class NoReset:
    def mul(self, a: int) -> int:
        """Doubles.

        Args:
            a: The number.
        """
        return 2 * a


class OnlyReset:
    def reset(self, **row):
        pass


def make_calc():
    return Calc()


def make_broken():
    raise RuntimeError("no licence")


def rollout(prompts, trainer):
    return {}


def rollout_one_arg(prompts):
    return {}
'''


@pytest.fixture
def user_pkg(tmp_path: Path, monkeypatch) -> Iterator[str]:
    name = "myagents_" + re.sub(r"\W", "_", tmp_path.name)
    pkg = tmp_path / "src" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(textwrap.dedent(MODULE))
    (pkg / "broken.py").write_text("def f(\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    yield name
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]


def test_good_entries_resolve_to_what_grpotrainer_takes_with_deadlines(user_pkg):
    a = resolve.resolve([f"{user_pkg}.mod:add"], f"{user_pkg}.mod:make_calc", f"{user_pkg}.mod:rollout", 5)
    assert resolve.problems([f"{user_pkg}.mod:add"], {"c": f"{user_pkg}.mod:Calc"}, f"{user_pkg}.mod:rollout") == []
    (tool,) = a.tools or []
    assert tool.__name__ == "add" and tool(a=2, b=3) == 5
    env = a.environment_factory()  # type: ignore[operator]
    env.reset()
    assert env.mul(a=3, b=4) == 12 and env.get_reward() == 1.0
    assert set(a.trainer_kwargs()) == {"tools", "environment_factory", "rollout_func"}
    named = resolve.resolve([], {"math": f"{user_pkg}.mod:Calc"}, "", 5).environment_factory
    assert isinstance(named, dict) and list(named) == ["math"]


PROBLEMS = [
    ("tools", "nopkg_zz.mod:f", "trainer.tools 'nopkg_zz.mod:f': cannot import module 'nopkg_zz.mod'"),
    ("tools", "{p}.broken:f", "importing module '{p}.broken' raised SyntaxError"),
    ("tools", "{p}.mod:nothing", "module '{p}.mod' has no 'nothing'"),
    ("tools", "{p}.mod:Calc", "is a type, not a function"),
    ("tools", "{p}.mod:undocumented", "cannot be described to the model"),
    ("environment", "{p}.mod:NoReset", "NoReset has no reset(**row) method"),
    ("environment", "{p}.mod:OnlyReset", "OnlyReset has no public method besides reset and get_reward"),
    ("environment", "{p}.mod:make_broken", "calling the factory raised RuntimeError: no licence"),
    ("environment", "{p}.mod:add", "calling the factory raised TypeError"),
    ("rollout_func", "{p}.mod:rollout_one_arg", "does not take (prompts, trainer)"),
    ("rollout_func", "{p}.mod:Calc", "is a type, not a function"),
]


@pytest.mark.parametrize("key, entry, needle", PROBLEMS, ids=[p[2][:40] for p in PROBLEMS])
def test_an_entry_that_cannot_be_resolved_is_one_line_naming_its_key(user_pkg, key, entry, needle):
    entry, needle = entry.format(p=user_pkg), needle.format(p=user_pkg)
    found = resolve.problems(
        [entry] if key == "tools" else [], entry if key == "environment" else "", entry if key == "rollout_func" else ""
    )
    assert len(found) == 1 and needle in found[0] and f"trainer.{key}" in found[0], found
    assert "\n" not in found[0]


def test_local_and_submit_checks_name_every_bad_entry_before_anything_starts(tmp_path, user_pkg, monkeypatch):
    """`slurm-grpo local` resolves the entries in a child as the ranks will (the launcher never imports them); submit
    looks for their modules only (the submit host may lack the GPU stack their imports need)."""
    src = str(tmp_path / "src")
    monkeypatch.setenv("PYTHONPATH", src)
    cfg = load(
        {
            "tools": [f"{user_pkg}.mod:add", f"{user_pkg}.mod:undocumented"],
            "environment": {"calc": f"{user_pkg}.mod:Calc", "bad": f"{user_pkg}.mod:NoReset"},
            "reward_funcs": [],
        },
        tmp_path=tmp_path,
    )
    found = agent_import_problems(cfg)
    assert len(found) == 2, found
    assert "trainer.tools" in found[0] and "undocumented" in found[0]
    assert "trainer.environment.bad" in found[1] and "NoReset has no reset" in found[1]
    assert agent_module_problems(cfg) == []  # all modules exist
    missing = load({"rollout_func": "nopkg_zz.roll:f"}, tmp_path=tmp_path)
    (line,) = agent_module_problems(missing)
    assert line.startswith("trainer.rollout_func 'nopkg_zz.roll:f': module 'nopkg_zz.roll' is not importable here")
    assert line in submit_path_problems(missing)
    assert agent_import_problems(load({}, tmp_path=tmp_path)) == []  # single-turn: no child at all


def test_submit_checks_read_each_entry_down_to_its_name_without_importing_it(tmp_path, user_pkg):
    """A name the module lacks (or a module that does not compile) fails dry-run and submit as it would `local`, found
    from the source as the rewards are: the launcher imports neither the module nor torch."""
    cfg = load(
        {"tools": [f"{user_pkg}.mod:nothing"], "environment": {"ok": f"{user_pkg}.mod:Calc", "bad": f"{user_pkg}.broken:f"}},
        tmp_path=tmp_path,
    )
    tool, env = agent_module_problems(cfg)
    assert (
        tool
        == f"trainer.tools '{user_pkg}.mod:nothing': module '{user_pkg}.mod' has no 'nothing'; fix the name after the ':' (defined in a way this reading of the source misses: --skip-checks agents)"
    )
    assert env.startswith(f"trainer.environment.bad '{user_pkg}.broken:f': ") and "SyntaxError" in env, env
    assert f"{user_pkg}.mod" not in sys.modules  # read, not imported
    pkg = next(Path(p) for p in sys.path if (Path(p) / user_pkg).is_dir()) / user_pkg
    (pkg / "pair.py").write_text("def _make():\n    return len, abs\n\n\ncount, size = _make()\n")
    assert agent_module_problems(load({"tools": [f"{user_pkg}.pair:size"]}, tmp_path=tmp_path)) == []  # a, b = ...
    sets = ["--skip-checks", "model", "--set", "trainer.environment=trainer.agents.countdown:Nope"]
    r = cli("dry-run", "configs/agents_cpu.yaml", *sets, "--set", f"job.job_dir={tmp_path / 'job'}")
    assert r.returncode == 2, r.stdout[-2000:]
    assert "trainer.environment 'trainer.agents.countdown:Nope': module 'trainer.agents.countdown' has no 'Nope'" in r.stdout
    assert "the agents check found problems" in r.stderr
    code = (
        "import sys; from launcher.core import config as C; from launcher.core.inputs import agent_module_problems; "
        "print(agent_module_problems(C.load('configs/agents_cpu.yaml')), 'torch' in sys.modules, "
        "'trainer.agents.countdown' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert r.stdout.split() == ["[]", "False", "False"], r.stdout + r.stderr


@pytest.mark.parametrize(
    "config, hint",
    [("agents_cpu", "python -m trainer.agents.tiny_tool_model DIR"), ("smoke_cpu", "slurm-grpo make-tiny-model DIR")],
)
def test_a_missing_model_folder_names_the_test_model_the_config_runs_on(tmp_path, config, hint):
    cfg = C.load(REPO / f"configs/{config}.yaml", [f"vllm.model={tmp_path / 'nope'}"])
    (line,) = [p for p in submit_path_problems(cfg, skip=("data", "rewards", "agents", "venv")) if "vllm.model" in p]
    assert line.endswith(f"build a test one with `{hint}`)"), line


def test_local_refuses_a_bad_tool_in_one_line_before_vllm_starts(tmp_path, tiny_model, user_pkg):
    fake = fake_vllm(tmp_path, "fake vLLM: exiting at once", exit_code=1)
    sets = [f"vllm.model={tiny_model}", f"job.job_dir={tmp_path / 'job'}", *port_sets()]
    sets += [f"trainer.tools=[{user_pkg}.mod:undocumented]"]
    conversations = REPO / "data/countdown.jsonl"  # tools need conversational prompts (checked too)
    sets += [f"trainer.dataset={conversations}", f"trainer.eval.dataset={conversations}"]
    r = cli(
        "local",
        str(REPO / "configs/smoke_cpu.yaml"),
        *[x for s in sets for x in ("--set", s)],
        env=clean_env(PYTHONPATH=f"{fake.pythonpath()}:{tmp_path / 'src'}"),
        timeout=300,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("slurm-grpo local: error: trainer.tools ") and "cannot be described to the model" in line, line
    assert fake.starts == [] and not (tmp_path / "job").exists()


# ----------------------------------------------------------------------------- deadlines


def test_a_tool_that_hangs_or_raises_ends_within_its_deadline_and_is_counted(user_pkg):
    deadline.CLOCK.take()
    env = resolve.resolve([], f"{user_pkg}.mod:Calc", "", 0.5).environment_factory()  # type: ignore[operator]
    env.reset()
    t0 = time.monotonic()
    with pytest.raises(deadline.ToolTimeout, match=r"tool 'Calc.slow' gave no result within 0.5 s \(trainer.tool_timeout_s\)"):
        env.slow(s=30)
    assert time.monotonic() - t0 < 5
    assert env.slow(s=0) == "woke"
    with pytest.raises(TypeError):  # the tool's own exception, as TRL would record it
        env.mul(a=1)
    figures_now = deadline.CLOCK.take()
    assert (figures_now["calls"], figures_now["failures"], figures_now["timeouts"]) == (3, 2, 1)
    assert 0.5 <= figures_now["seconds"] < 5


def test_async_tools_get_the_deadline_too():
    async def nap(s: float) -> str:
        """Naps.

        Args:
            s: Seconds.
        """
        await asyncio.sleep(s)
        return "up"

    timed = deadline.with_deadline(nap, 0.3)
    assert inspect.iscoroutinefunction(timed)  # TRL runs it on its event loop, as an async tool
    assert asyncio.run(timed(s=0)) == "up"
    with pytest.raises(deadline.ToolTimeout):
        asyncio.run(timed(s=30))


def test_wrapped_tools_describe_themselves_to_the_model_as_the_originals(user_pkg):
    """TRL renders each tool from its name, signature, type hints and docstring; TRL finds an environment's tools on
    its class (inspect.getmembers ... isfunction) and calls them bound."""
    from transformers.utils import get_json_schema

    mod = sys.modules.get(f"{user_pkg}.mod") or __import__(f"{user_pkg}.mod", fromlist=["x"])
    assert get_json_schema(deadline.with_deadline(mod.add, 1)) == get_json_schema(mod.add)
    env = deadline.environment_with_deadlines(mod.Calc, 1)()
    assert isinstance(env, mod.Calc) and type(env).__name__ == "Calc"
    assert deadline.tool_methods(type(env)) == ["mul", "slow"]
    assert get_json_schema(env.mul) == get_json_schema(mod.Calc().mul)


def test_turns_count_the_tool_results_an_episode_read():
    assert figures.turns(None, 3) == [1, 1, 1]
    assert figures.turns([[1, 1], [1, 0, 0, 1, 1], [1, 0, 1, 0, 0, 1]], 3) == [1, 2, 3]


# ----------------------------------------------------------------------------- the tool-calling tiny model


@pytest.fixture(scope="module")
def one_layer_tool_model(tmp_path_factory) -> Path:
    from trainer.agents.tiny_tool_model import make_tool_model

    path = tmp_path_factory.mktemp("tool") / "m"
    make_tool_model(path)
    return path


def test_the_tiny_tool_model_calls_the_tool_until_done_then_answers(one_layer_tool_model):
    """The hand-set weights through transformers, and TRL's own parser of the Qwen2.5 response: the model calls
    countdown after the prompt and after AGAIN, answers after DONE, each by a wide logit margin."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import add_response_schema, parse_response

    from trainer.agents.countdown import Countdown
    from trainer.agents.tiny_tool_model import CALL

    tok = add_response_schema(AutoTokenizer.from_pretrained(one_layer_tool_model))
    model = AutoModelForCausalLM.from_pretrained(one_layer_tool_model)
    tools = [Countdown().countdown]
    user = [{"role": "user", "content": "count down, please"}]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "countdown", "arguments": {}}}],
    }

    def answer(messages) -> tuple[list[int], list[int], float]:
        ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
        logits = model(torch.tensor([ids])).logits[0, -1]
        top2 = logits.topk(2).values
        return ids, out, float((top2[0] - top2[1]).detach())

    ids, out, margin = answer(user)
    assert tok.decode(out) == f"<tool_call>{CALL}</tool_call><|im_end|>" and margin > 10
    assert parse_response(tok, out, prefix=ids, tools=tools)["tool_calls"] == call["tool_calls"]
    _, out, margin = answer([*user, call, {"role": "tool", "name": "countdown", "content": "AGAIN"}])
    assert tok.decode(out) == f"<tool_call>{CALL}</tool_call><|im_end|>" and margin > 10
    again = [*user, call, {"role": "tool", "name": "countdown", "content": "AGAIN"}]
    _, out, margin = answer([*again, call, {"role": "tool", "name": "countdown", "content": "DONE"}])
    assert tok.decode(out) == "ok<|im_end|>" and margin > 10


TOOL_CONVERSATIONS: tuple[list[dict[str, str]], ...] = (
    [],
    [{"role": "tool", "name": "countdown", "content": "AGAIN"}],
    [{"role": "tool", "name": "countdown", "content": "AGAIN"}, {"role": "tool", "name": "countdown", "content": "DONE"}],
)
"""Tool results read so far; the model must call, call again, then answer."""


def tool_prompts(tok) -> list[list[int]]:
    """The agents prompts as TRL renders them (the countdown's schema in the system turn), after 0, 1 and 2 results."""
    from trainer.agents.countdown import Countdown

    user = [{"role": "user", "content": "count down, please"}]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "countdown", "arguments": {}}}],
    }
    out = []
    for results in TOOL_CONVERSATIONS:
        messages = [*user, *[m for r in results for m in (call, r)]]
        out.append(
            tok.apply_chat_template(
                messages, tools=[Countdown().countdown], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return out


def test_a_deep_tool_model_is_the_one_layer_model_with_inert_layers(one_layer_tool_model, tmp_path):
    """Issue 37: depth, GQA width, MLP size and a padded vocabulary change nothing the model writes. Layers 1-3 compute
    (random q/k/v/gate/up) but add exactly zero to the residual stream, so every position's logits equal the one-layer
    model's bit for bit (the padding's ids sit at 0), greedy episodes are the same, and a loss still reaches the inert
    layers' zero o_proj (training moves them once rewards differ)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.agents.tiny_tool_model import CALL, make_tool_model

    info = make_tool_model(tmp_path / "deep", layers=4, kv_heads=2, intermediate=384, vocab=1024)
    assert (info["layers"], info["vocab"], info["tokens"]) == (4, 1024, 308)
    tok = AutoTokenizer.from_pretrained(tmp_path / "deep")
    one = AutoModelForCausalLM.from_pretrained(one_layer_tool_model)
    deep = AutoModelForCausalLM.from_pretrained(tmp_path / "deep")
    assert (deep.config.num_hidden_layers, deep.config.num_key_value_heads, deep.config.intermediate_size) == (4, 2, 384)
    for layer in deep.model.layers[1:]:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert layer.self_attn.k_proj.weight.std() > 0.01 and layer.mlp.up_proj.weight.std() > 0.01
    want = [f"<tool_call>{CALL}</tool_call><|im_end|>"] * 2 + ["ok<|im_end|>"]
    with torch.no_grad():
        for ids, text in zip(tool_prompts(tok), want, strict=True):
            out = deep.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0]
            assert tok.decode(out[len(ids) :]) == text
            a, b = one(out[None]).logits, deep(out[None]).logits  # every position, the prompt's and the answer's
            assert torch.equal(b[..., : a.shape[-1]], a) and not b[..., a.shape[-1] :].any()
    x = torch.tensor([tool_prompts(tok)[1]])
    deep(x, labels=x).loss.backward()
    assert deep.model.layers[2].self_attn.o_proj.weight.grad.abs().sum() > 0


def test_the_tool_model_in_a_real_agents_shape_keeps_its_chain(tmp_path):
    """--like with overrides (a Qwen2 preset shrunk for CPU), head_dim 128 as the 1.5 B and 3 B shapes have, saved in
    bfloat16 as the GPU run builds it: the chain holds (call, call, answer) with wide margins."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.agents import tiny_tool_model as ttm

    out = tmp_path / "m"
    args = ["--like", "qwen2-1.5b", "--hidden", "256", "--layers", "3", "--intermediate", "512", "--vocab", "2048"]
    assert ttm.main([*args, "--dtype", "bfloat16", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    c = model.config
    assert (c.num_hidden_layers, c.head_dim, c.num_key_value_heads, c.vocab_size) == (3, 128, 2, 2048)
    assert model.dtype == torch.bfloat16
    want = [f"<tool_call>{ttm.CALL}</tool_call><|im_end|>"] * 2 + ["ok<|im_end|>"]
    with torch.no_grad():
        for ids, text in zip(tool_prompts(tok), want, strict=True):
            x = torch.tensor([ids])
            top2 = model(x).logits[0, -1].float().topk(2).values
            assert top2[0] - top2[1] > 20
            assert tok.decode(model.generate(x, max_new_tokens=12, do_sample=False)[0, len(ids) :]) == text
    assert ttm.main(["--hidden", "192", "--head-dim", "128", str(tmp_path / "bad")]) == 2  # not a multiple
