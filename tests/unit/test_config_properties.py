"""Property tests of the config's front door: thousands of configs and --set lines, typed as users type them (unquoted
YAML, typos, numbers with leading zeros, base-60 times, pass-through flags the launcher owns), valid and broken. Each
one either plans, and then the sbatch header sbatch reads back holds exactly what the user wrote, or fails with one
ConfigError of one short line that names a key. Never a traceback, never a value silently turned into another."""

from __future__ import annotations

import dataclasses
import re
import typing

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from launcher.cli import build_parser, expand_sets
from launcher.core import config as C
from launcher.core.plan import plan
from launcher.submit import sbatch_text
from tests.unit.test_sbatch import sbatch_header

JOB_DIR = "/tmp/prop-job"
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_MESSAGE = 200


def assert_one_short_line(e: C.ConfigError) -> None:
    msg = str(e)
    assert "\n" not in msg and 0 < len(msg) <= MAX_MESSAGE, f"{len(msg)} chars: {msg!r}"


def all_keys() -> list[str]:
    """Every settable key, dotted (nested groups too): slurm.container.image, trainer.lora.r, ..."""
    out = []

    def walk(prefix: str, cls: type) -> None:
        for name, ann in typing.get_type_hints(cls).items():
            if name.isupper():
                continue
            if isinstance(ann, type) and dataclasses.is_dataclass(ann):
                walk(f"{prefix}.{name}", ann)
            else:
                out.append(f"{prefix}.{name}")

    for section, cls in C.SECTIONS.items():
        walk(section, cls)
    return out


KEYS = all_keys()
PARSER = build_parser()

# scalars as typed into YAML without quotes: digits with leading zeros, base-60 times, floats with trailing zeros,
# YAML 1.1 booleans and nulls, hex, underscores, words. No spaces, '#' or ': ' (those change the YAML's shape).
token = st.one_of(
    st.from_regex(r"\A[0-9]{1,3}(:[0-9]{1,2}){0,2}\Z"),
    st.from_regex(r"\A[0-9]{1,2}-[0-9]{1,2}(:[0-9]{2}){0,2}\Z"),
    st.from_regex(r"\A-?0?[0-9]{1,4}(\.[0-9]{0,3})?([eE]-?[0-9])?\Z"),
    st.sampled_from(["yes", "no", "on", "off", "true", "false", "null", "~", "0x1f", "1_000", "0o17", ".inf", "2026-01-01"]),
    st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_.-]{0,12}\Z"),
)


def plan_or_refuse(load) -> tuple[C.JobConfig, str] | None:
    """Load a config, plan it and render its sbatch text as dry-run does: (the config, the sbatch text), or
    None after checking the refusal is one short line. A planned config must read back from its config.yaml unchanged."""
    try:
        cfg = load()
        text = sbatch_text(cfg, plan(cfg, JOB_DIR))
    except C.ConfigError as e:
        assert_one_short_line(e)
        event("refused")
        return None
    event("planned")
    assert C.from_dict(C.read_yaml(C.to_yaml(cfg))) == cfg  # the job folder's config.yaml reads back the same (resume)
    return cfg, text


def typo(key: str, data: st.DataObject) -> str:
    """The key with one character dropped, doubled or swapped (sometimes still a valid key)."""
    i = data.draw(st.integers(0, len(key) - 1))
    how = data.draw(st.sampled_from(["drop", "double", "swap"]))
    if how == "drop":
        return key[:i] + key[i + 1 :]
    if how == "double":
        return key[:i] + key[i] + key[i:]
    return key[:i] + key[i + 1 : i + 2] + key[i : i + 1] + key[i + 2 :]


@FAST
@given(data=st.data())
def test_any_set_line_plans_or_fails_with_one_short_line(data):
    lines = ["vllm.model=/m", f"job.job_dir={JOB_DIR}"]
    for _ in range(data.draw(st.integers(1, 4))):
        key = data.draw(st.sampled_from(KEYS))
        if data.draw(st.booleans()) and len(key) > 3:
            key = typo(key, data)
        value = data.draw(st.one_of(token, st.sampled_from(["[--port, 9000]", "{nodes: 2}", "[a, b]", "{}", "[]", ""])))
        if key == "slurm.layout" and data.draw(st.booleans()):
            value = data.draw(st.sampled_from(["shared", "split"]))  # a real choice, else only refused as unknown
        lines.append(f"{key}={value}")
    planned = plan_or_refuse(lambda: C.load(None, lines))  # what dry-run does: load, plan, render
    if planned is None:
        return
    cfg, text = planned
    header = sbatch_header(text)
    assert header["--nodes"] == str(cfg.slurm.nodes) and header["--time"] == cfg.slurm.time
    # every plain string field got exactly the text after '=' (a number keeps its digits, a time stays a time)
    for line in lines:
        key, _, value = line.partition("=")
        section, _, name = key.partition(".")
        if "." in name or name not in typing.get_type_hints(C.SECTIONS[section]):
            continue
        if typing.get_type_hints(C.SECTIONS[section])[name] is str:
            last = [x for x in lines if x.startswith(key + "=")][-1].partition("=")[2]
            # a path key's leading ~ is expanded where the config is built (C.expand_home), once
            assert getattr(getattr(cfg, section), name) == C.expand_home(key, last)


good_time = st.one_of(
    st.builds("{:02d}:{:02d}:{:02d}".format, st.integers(0, 99), st.integers(0, 59), st.integers(0, 59)),
    st.builds("{}-{:02d}:{:02d}:00".format, st.integers(0, 9), st.integers(0, 23), st.integers(0, 59)),
    st.builds(str, st.integers(10, 9999)),
)
name = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,10}\Z")  # 0123, 1.10, gpu-a100, 2026-01-01 ...
slurm_value = {
    "time": st.one_of(good_time, good_time, token),
    "account": st.one_of(name, token),
    "partition": st.one_of(name, token),
    "qos": st.one_of(name, token),
    "constraint": st.one_of(name, token),
    "mem": st.one_of(st.from_regex(r"\A[1-9][0-9]{0,3}[KMGT]?\Z"), token, st.from_regex(r"\A-?[0-9]{1,4}[KMGTB]{0,2}\Z")),
    "nodes": st.one_of(st.builds(str, st.integers(1, 64)), token),
    "gpus_per_node": st.sampled_from(["2", "4", "8", "08", "1_6", "0", "x"]),
}
SHEET = {"time": "--time", "account": "--account", "partition": "--partition", "qos": "--qos", "constraint": "--constraint"}
SHEET |= {"mem": "--mem", "nodes": "--nodes", "gpus_per_node": "--gpus-per-node"}


@FAST
@given(
    values=st.fixed_dictionaries({}, optional=slurm_value),
    extra=st.dictionaries(
        st.sampled_from(
            [
                "nodes",
                "time",
                "gres",
                "ntasks-per-node",
                "ntasks_per_node",
                "reservation",
                "mail-type",
                "no",
                "t",
                "gpus",
                "begin",
            ]
        ),
        token,
        max_size=2,
    ),
)
def test_a_yaml_file_reaches_the_sbatch_header_as_written_or_is_refused(values, extra):
    lines = ["vllm: {model: /m}", "trainer: {per_device_train_batch_size: 8, num_generations: 8}", "slurm:"]
    lines += [f"  {k}: {v}" for k, v in values.items()]
    if extra:
        lines += ["  extra_sbatch:"] + [f"    {k}: {v}" for k, v in extra.items()]
    # what C.load does with a file, from the text; then plan and render as dry-run does
    planned = plan_or_refuse(lambda: C.from_dict(C.merge_raw(C.read_yaml("\n".join(lines) + "\n"), [f"job.job_dir={JOB_DIR}"])))
    if planned is None:
        return
    cfg, text = planned
    header = sbatch_header(text)
    for key, typed in values.items():
        if key in ("nodes", "gpus_per_node"):  # an integer as typed: digits, maybe with YAML's underscores
            assert re.fullmatch(r"[+]?[1-9][0-9_]*", typed), typed
            assert header[SHEET[key]] == typed.lstrip("+").replace("_", "")
        else:
            assert header[SHEET[key]] == typed, (key, typed, header)
    for key, typed in extra.items():
        assert key not in C.SBATCH_OWNED or (key == "gres" and "gpu" not in typed)  # gres: nvme is the user's
        assert header[f"--{key}"] == typed
    owned = {f for f in header if f.lstrip("-") in C.SBATCH_OWNED}
    assert all(header_line_count(text, f) == 1 for f in owned)  # the launcher's directives, once each


def header_line_count(text: str, flag: str) -> int:
    return sum(1 for line in text.splitlines() if line.startswith(f"#SBATCH {flag}=") or line == f"#SBATCH {flag}")


@FAST
@given(
    args=st.lists(
        st.one_of(st.sampled_from(list(C.VLLM_OWNED)), st.sampled_from(["enforce-eager", "max-num-seqs"])), min_size=1, max_size=3
    ),
    style=st.sampled_from(["--{}", "--{}=1", "-{}", "--{_}"]),
)
def test_vllm_extra_args_never_repeat_a_flag_the_launcher_passes(args, style):
    flags = [style.replace("{_}", a.replace("-", "_")).format(a) for a in args]
    try:
        cfg = C.load(None, ["vllm.model=/m", f"job.job_dir={JOB_DIR}", f"vllm.extra_args={flags!r}"])
    except C.ConfigError as e:
        assert_one_short_line(e)
        assert any(a in C.VLLM_OWNED for a in args) and "set by slurm-grpo" in str(e)
        return
    assert not any(a in C.VLLM_OWNED for a in args)
    assert cfg.vllm.extra_args == flags


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.builds("{}={}".format, st.sampled_from(KEYS), token), min_size=1, max_size=4))
def test_one_set_takes_several_pairs_as_simulate_prints_them(pairs):
    a = PARSER.parse_args(expand_sets(["dry-run", "--set", *pairs, "c.yaml", "--set", "trainer.max_steps=3"]))
    assert a.overrides == [*pairs, "trainer.max_steps=3"] and a.config == "c.yaml"


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(sorted(C.grpo_config_annotations() or {})), value=st.one_of(token, st.booleans(), st.none()))
def test_any_trainer_grpo_entry_is_accepted_or_refused_in_one_line(key, value):
    try:
        cfg = C.from_dict(
            {"vllm": {"model": "/m"}, "trainer": {"grpo": {key: C.read_yaml(value) if isinstance(value, str) else value}}}
        )
    except C.ConfigError as e:
        assert_one_short_line(e)
        assert f"trainer.grpo.{key}" in str(e)
        return
    assert key not in C.GRPO_OWNED
    if key in C.GRPO_CHOICES:
        assert cfg.trainer.grpo[key] in C.GRPO_CHOICES[key]
