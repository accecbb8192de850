"""The memory estimate of dry-run and simulate (launcher/memory.py): its parameter count against transformers' own,
the GPU size from its name, and what dry-run tells a user of the 7B example with and without the options."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from launcher.cli import main as cli_main
from launcher.core.shape import ModelShape
from launcher.memory import Layout, Options, common_shape, estimate, gpu_memory_gb, report

REPO = Path(__file__).resolve().parents[2]

QWEN7B = {
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}


def test_the_parameter_count_is_what_transformers_builds(tmp_path):
    for extra in ([], ["--untied", "--layers", "3", "--kv-heads", "2", "--hidden", "256"]):
        out = tmp_path / ("m" + str(len(extra)))
        made = subprocess.run(
            [sys.executable, "-m", "trainer.tiny_model", str(out), *extra], check=True, capture_output=True, text=True
        ).stdout
        built = int(made.split("'params': ")[1].split(",")[0])
        shape = ModelShape.read(str(out))
        assert shape is not None and shape.params == built, (shape, built)
    # and the published size of a real shape (Qwen2.5-7B: 7.62B)
    assert abs(common_shape("Qwen2.5-7B").params / 1e9 - 7.615) < 0.005


def test_the_gpu_size_comes_from_the_setting_or_a_known_name():
    assert gpu_memory_gb(0, "h100", "") == 80
    assert gpu_memory_gb(0, "", "gpu-a100-40gb") == 40
    assert gpu_memory_gb(0, "nvidia_h200", "") == 141
    assert gpu_memory_gb(96, "h100") == 96
    assert gpu_memory_gb(0, "batch", "cpu") == 0


def _lay(**kw) -> Layout:
    base = dict(
        nodes=4,
        ranks_per_node=7,
        tensor_parallel_size=1,
        shard_ranks=7,
        shared_gpu=False,
        gpu_gb=80.0,
        vllm_fraction=0.85,
        compute_bytes=2,
        completions_per_rank=16,
        completion_tokens=1024,
    )
    return Layout(**{**base, **kw})  # type: ignore[arg-type]


def test_each_option_lowers_the_term_it_is_for():
    shape = common_shape("Qwen2.5-7B")
    plain, ac = estimate(shape, _lay(), Options()), estimate(shape, _lay(), Options(activation_checkpointing=True))
    off = estimate(shape, _lay(), Options(cpu_offload=True))
    full = estimate(shape, _lay(), Options(sharded_loading=False))
    assert ac.activations_gb < plain.activations_gb / 5 and ac.state_gb == plain.state_gb
    assert off.gpu_gb < plain.gpu_gb - plain.state_gb + 0.1 and off.host_gb_per_node > 100
    # the old loader: the whole fp32 model on every rank, 7 x 30 GB of host memory per node
    assert full.load_host_gb_per_node > 200 > 10 > estimate(shape, _lay(), Options()).load_host_gb_per_node
    # fsdp over 4 nodes shards the state 4x thinner than hsdp within a node
    assert abs(estimate(shape, _lay(shard_ranks=28), Options()).state_gb * 4 - plain.state_gb) < 1e-6


def test_dry_run_prints_the_estimate_and_warns_with_the_fix(tmp_path, capsys):
    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN7B))
    argv = ["dry-run", str(REPO / "configs" / "gpu_7b_4nodes.yaml"), "--set", f"vllm.model={model}", "--skip-checks", "all"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    section = out.split("# memory estimate")[1].split("# sbatch")[0]
    assert "model 7.62B parameters; shards over 7 ranks" in section and "budget: 80 GB" in section, section
    assert "WARNING" not in section, section  # the example config turns activation checkpointing on
    assert cli_main(argv + ["--set", "trainer.activation_checkpointing=false"]) == 0
    section = capsys.readouterr().out.split("# memory estimate")[1].split("# sbatch")[0]
    assert "WARNING: a trainer rank needs" in section and "trainer.activation_checkpointing=true" in section, section


def test_a_reference_model_is_a_whole_fp32_copy_on_every_rank(tmp_path, capsys):
    """trainer.beta > 0: TRL builds its reference model unsharded in the policy's dtype (fp32 master weights) on every
    rank; at 7B that is 30 GB per rank, which the estimate and its fix must count."""
    shape = common_shape("Qwen2.5-7B")
    plain, ref = estimate(shape, _lay(), Options()), estimate(shape, _lay(), Options(reference_model=True))
    assert plain.reference_gb == 0 and abs(ref.reference_gb - 4 * shape.params / 1e9) < 1e-6
    assert abs(ref.gpu_gb - plain.gpu_gb - ref.reference_gb) < 1e-6
    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN7B))
    argv = ["dry-run", str(REPO / "configs" / "gpu_7b_4nodes.yaml"), "--set", f"vllm.model={model}", "--set", "trainer.beta=0.04"]
    argv += ["--skip-checks", "all"]  # the config's data is on its cluster
    assert cli_main(argv) == 0
    section = capsys.readouterr().out.split("# memory estimate")[1].split("# sbatch")[0]
    assert "reference model 30.5 (trainer.beta > 0: TRL's unsharded fp32 copy)" in section, section


QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "tie_word_embeddings": False,
}


def test_an_moe_counts_every_expert_in_total_and_the_routed_ones_as_active(tmp_path, capsys):
    """Published sizes (total / active): Qwen3-30B-A3B 30.53B / 3.35B, Mixtral-8x7B 46.70B / 12.88B; the tiny MoE bodies
    of every MoE family, with a dense layer among the sparse ones, to the parameter as transformers builds them; and
    what dry-run prints for the 30B."""
    model = tmp_path / "qwen3-30b-a3b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    shape = ModelShape.read(str(model))
    assert shape is not None and shape.moe_layers == 48
    assert abs(shape.params / 1e9 - 30.53) < 0.01 and abs(shape.active_params / 1e9 - 3.35) < 0.01, shape
    mixtral = common_shape("Mixtral-8x7B")
    assert abs(mixtral.params / 1e9 - 46.70) < 0.01 and abs(mixtral.active_params / 1e9 - 12.88) < 0.01
    # gpt-oss: OpenAI's model card gives 20.91B / 3.61B and 116.83B / 5.13B, its active count without the input
    # embedding (201088 x 2880 = 0.58B), which a token only looks up
    embedding = 201088 * 2880 / 1e9
    for name, total, active in (("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13)):
        oss = common_shape(name)
        assert abs(oss.params / 1e9 - total) < 0.01 and abs(oss.active_params / 1e9 - embedding - active) < 0.01, oss
    assert common_shape("Qwen3-30B-A3B") == shape
    # a gathered unit is a whole MoE layer; its activations run only the routed experts
    e = estimate(shape, _lay(), Options())
    assert e.state_gb > 16 * 30.5 / 7 and e.gathered_gb > 2 * 2 * 0.6
    # every MoE family's tiny body, and a dense layer among MoE ones, against transformers: test_shape_families.py
    argv = ["dry-run", str(REPO / "configs" / "gpu_7b_4nodes.yaml"), "--set", f"vllm.model={model}", "--skip-checks", "all"]
    assert cli_main(argv) == 0
    section = capsys.readouterr().out.split("# memory estimate")[1].split("# sbatch")[0]
    assert "model 30.53B parameters (3.35B active per token: 8 of 128 experts)" in section, section
    # Qwen3-235B-A22B: one layer's gate_up_proj is 3 GiB in bf16, over the ipc push's default 2 GiB buffer
    big = ModelShape(4096, 94, 12288, 151936, 64, 4, 128, False, 128, 8, 1536, moe_layers=94)
    assert abs(big.params / 1e9 - 235.1) < 0.1 and abs(big.active_params / 1e9 - 22.1) < 0.1, (big.params, big.active_params)
    warn = [x for x in report(big, _lay(push_buffer_bytes=2048 * 2**20), Options()) if "ipc push buffer" in x and "WARN" in x]
    assert warn and "trainer.ipc_buffer_mb >= 3072" in warn[0], warn
    assert not [x for x in report(shape, _lay(push_buffer_bytes=2048 * 2**20), Options()) if "WARNING: the largest" in x]


def test_per_modality_moe_fields_read_as_the_text_models(tmp_path):
    """ERNIE-4.5-VL gives moe_num_experts, moe_k and moe_intermediate_size per modality (lists): read as the text
    model's (the first), never a crash of every dry-run (REVIEW-diff 5)."""
    vl = {"model_type": "ernie4_5_moe_vl", "hidden_size": 2560, "num_hidden_layers": 28, "intermediate_size": 12288,
          "num_attention_heads": 20, "num_key_value_heads": 4, "vocab_size": 103424, "moe_num_experts": [64, 64],
          "moe_k": 6, "moe_intermediate_size": [1536, 512], "moe_layer_start_index": 1, "moe_num_shared_experts": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(vl))
    shape = ModelShape.read(str(tmp_path))
    assert shape is not None and (shape.experts, shape.experts_per_token, shape.expert_intermediate) == (64, 6, 1536)
    assert shape.moe_layers == 27 and shape.params > shape.active_params


def test_the_activation_estimate_takes_the_datasets_longest_prompt(tmp_path, capsys):
    """TRL pads a batch to its longest prompt: the estimate's T counts the dataset's longest (its tokenizer.json's
    count where the model folder has one, else 3 characters a token; + the chat template's allowance), and assumes
    256 tokens only where it cannot read the prompts (here: Parquet)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from launcher.core.inputs import CHAT_TEMPLATE_TOKENS

    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN7B))
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # one token a word
    tok.save(str(model / "tokenizer.json"))
    data = tmp_path / "d.jsonl"
    long = " ".join(["word"] * 900)  # 900 tokens, 4499 characters
    rows = [{"prompt": "short one", "answer": "1"}] * 300 + [{"prompt": [{"role": "user", "content": long}], "answer": "2"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def t_line(*sets: str) -> str:
        argv = ["dry-run", str(REPO / "configs" / "gpu_7b_4nodes.yaml"), "--skip-checks", "all"]
        for s in (f"vllm.model={model}", f"trainer.dataset={data}", *sets):
            argv += ["--set", s]
        assert cli_main(argv) == 0
        out = capsys.readouterr().out
        return next(line for line in out.split("# memory estimate")[1].splitlines() if "T = " in line)

    assert (
        f"T = 16 completions x ({900 + CHAT_TEMPLATE_TOKENS} prompt + 1024) tokens per rank (prompt: the dataset's longest prompt, by its tokenizer, + template)"
        in t_line()
    )
    system = "three more words"  # trainer.system_prompt is prepended to every prompt
    assert (
        f"({903 + CHAT_TEMPLATE_TOKENS} prompt + 1024) tokens per rank (prompt: the dataset's longest prompt + system prompt, by"
        in t_line(f"trainer.system_prompt={system}")
    )
    (model / "tokenizer.json").unlink()
    assert (
        f"({1500 + CHAT_TEMPLATE_TOKENS} prompt + 1024) tokens per rank (prompt: the dataset's longest prompt, 4499 chars / 3, + template)"
        in t_line()
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": [long] * 300, "answer": ["1"] * 300}), parquet)
    assert "(256 prompt + 1024) tokens per rank (prompt: assumed)" in t_line(f"trainer.dataset={parquet}")


def test_gpt_oss_attention_runs_eagerly_and_the_estimate_counts_its_scores(tmp_path):
    """transformers 5.19 gives gpt-oss no SDPA path (its attention sinks): the trainer's model runs eager attention,
    whose scores (completions x heads x L^2 per layer) the estimate adds; a dense family's attention adds nothing."""
    import dataclasses

    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.tiny_model import make_tiny_model

    make_tiny_model(tmp_path / "oss", family="gpt_oss", tie=False)
    config = AutoConfig.from_pretrained(tmp_path / "oss")
    assert AutoModelForCausalLM.from_config(config).config._attn_implementation == "eager"
    shape = ModelShape.read(str(tmp_path / "oss"))
    assert shape is not None and shape.eager_attention and shape.biases
    oss, lay = common_shape("gpt-oss-20b"), _lay()
    assert oss.eager_attention and not common_shape("Qwen3-30B-A3B").eager_attention
    plain = dataclasses.replace(oss, eager_attention=False)
    scores = lay.completions_per_rank * 64 * (lay.prompt_tokens + lay.completion_tokens) ** 2
    for checkpointing, per_score in ((True, 8), (False, 2 * 24 + 6)):
        opt = Options(activation_checkpointing=checkpointing)
        added = estimate(oss, lay, opt).activations_gb - estimate(plain, lay, opt).activations_gb
        assert abs(added - scores * per_score / 1e9) < 1e-6, (checkpointing, added)
    # trainer.attn_implementation: flex attention (or a flash kernel with sinks) keeps no scores; eager on any family does
    flex = Options(activation_checkpointing=True, attention="flex_attention")
    assert estimate(oss, lay, flex).activations_gb == estimate(plain, lay, flex).activations_gb
    eager = Options(activation_checkpointing=True, attention="eager")
    assert estimate(plain, lay, eager).activations_gb > estimate(plain, lay, flex).activations_gb


def test_vllm_weights_too_big_for_a_one_gpu_node_get_one_fix_that_holds(tmp_path, capsys):
    """The audit's case: a 7B model on one 24 GB GPU (math_example: vLLM at 0.35 of the GPU it shares). No TP of a
    1-GPU node holds its 15 GB of weights in 8 GB, so the estimate must not say to raise TP; it and the memory check
    name the same fix, which holds when followed: a 2-GPU node where vLLM has a GPU of its own at 0.9 of it."""
    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN7B))
    argv = ["dry-run", str(REPO / "configs" / "math_example.yaml"), "--set", f"vllm.model={model}", "slurm.gpu_memory_gb=24"]
    argv += ["--skip-checks", "model,data,rewards,agents,venv"]
    assert cli_main(argv) == 2  # the memory check refuses it
    out = capsys.readouterr().out
    problem = next(ln for ln in out.splitlines() if ln.startswith("  PROBLEM: vLLM's weights"))
    check = out.split("  memory   PROBLEM")[1].splitlines()[1]
    fix = (
        "no vllm.tensor_parallel_size of a 1-GPU node holds them at gpu_memory_utilization 0.35: --set "
        "slurm.layout=split slurm.gpus_per_node=2 vllm.gpu_memory_utilization=0.9 (the split layout: vLLM on GPUs of its own, 15 GB per "
        "GPU), GPUs with more memory, or a smaller model"
    )
    assert problem.endswith(f"in 8 GB: {fix}") and check.endswith(f"; {fix}"), (problem, check)
    assert "raise vllm.tensor_parallel_size" not in out
    followed = ["--set", "slurm.layout=split", "slurm.gpus_per_node=2", "vllm.gpu_memory_utilization=0.9"]
    assert cli_main([*argv, *followed]) == 0
    out = capsys.readouterr().out
    assert "PROBLEM" not in out and re.search(r"^  memory +ok", out, re.M), out
    # a config that chose the shared layout: the fix names the split layout too, and holds
    assert cli_main([*argv, "--set", "slurm.layout=shared", *followed]) == 0
    # a split node: the trainer keeps its GPU and vLLM may take more of its own
    from launcher.memory import vllm_weights_fix

    lay = Layout(1, 1, 1, 1, False, 24.0, 0.35, 2, 8, 256)
    assert vllm_weights_fix(common_shape("Qwen2.5-7B"), lay).endswith(
        "0.35: --set vllm.gpu_memory_utilization=0.9 (15 GB per GPU), GPUs with more memory, or a smaller model"
    )
