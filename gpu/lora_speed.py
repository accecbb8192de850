# ruff: noqa: E402, E741  (a device experiment: vLLM must see VLLM_ENABLE_V1_MULTIPROCESSING before its import)
"""Which cause makes generation through a runtime-(re)loaded LoRA adapter slow?  One vllm.LLM, in-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the worker's adapter loads can be counted.  Same work as a GRPO step:
64 prompts x 128 tokens (ignore_eos), the 0.36B Qwen2 body, r=16 on q,k,v,o,gate,up,down, max_loras=1.

  python3 lora_speed.py MODEL_DIR [OUT_JSON]         (model: python3 -m trainer.tiny_model ... as gpu/device.sh)

Arms (each timed after one untimed warm-up of the same arm):
  base            no adapter                                      (expect ~0.6 s)
  inplace_req     requests carry load_inplace=True  = what /v1/load_lora_adapter(load_inplace) stores and every
                  /v1/completions naming the adapter reuses       (expect ~5 s, loads == engine steps)
  plain_req       same id/path, load_inplace=False                (expect ~0.7 s, loads == 0)
  push_then_plain engine add_lora(new path, load_inplace=True) as a push, then requests with load_inplace=False:
                  fast AND the new weights are served (tokens differ from adapter 1's)
  new_id          a new name + id per push, load_inplace=False (the client-only fix)
  inplace_req_patched  the project's fix (trainer.push.vllm_plugin.load_adapters_once, applied last: it stays on):
                  requests carry load_inplace=True again (expect ~0.7 s, loads == 0). On CUDA this runs vLLM's Model
                  Runner V2 (CPU runs only reached V1): the proof that the fix reaches it (G4 of GPU-AUDIT turn 4).
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
from safetensors.torch import save_file
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora import worker_manager
from vllm.lora.request import LoRARequest

model = sys.argv[1]
out_json = sys.argv[2] if len(sys.argv) > 2 else None
cfg = json.load(open(os.path.join(model, "config.json")))
H, L, I = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
KV = cfg["num_key_value_heads"] * hd
R = 16
SHAPES = {
    "self_attn.q_proj": (H, H),
    "self_attn.k_proj": (H, KV),
    "self_attn.v_proj": (H, KV),
    "self_attn.o_proj": (H, H),
    "mlp.gate_proj": (H, I),
    "mlp.up_proj": (H, I),
    "mlp.down_proj": (I, H),
}


def write_adapter(path: str, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    t = {}
    for i in range(L):
        for mod, (fin, fout) in SHAPES.items():
            p = f"base_model.model.model.layers.{i}.{mod}"
            t[p + ".lora_A.weight"] = (torch.randn(R, fin, generator=g) / fin**0.5).to(torch.bfloat16)
            t[p + ".lora_B.weight"] = (torch.randn(fout, R, generator=g) * 0.5).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    json.dump(
        {
            "r": R,
            "lora_alpha": 32,
            "lora_dropout": 0.0,
            "bias": "none",
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "target_modules": [m.split(".")[1] for m in SHAPES],
        },
        open(os.path.join(path, "adapter_config.json"), "w"),
    )
    return path


loads = []
_orig_load = worker_manager.WorkerLoRAManager._load_adapter


def counting_load(self, req):
    loads.append(req.lora_path)
    return _orig_load(self, req)


worker_manager.WorkerLoRAManager._load_adapter = counting_load

a1, a2, a3 = (write_adapter(f"/tmp/lora_speed/a{k}", k) for k in (1, 2, 3))
llm = LLM(
    model=model,
    dtype=os.environ.get("LS_DTYPE", "bfloat16"),
    max_model_len=512,
    gpu_memory_utilization=0.35,
    seed=0,
    enable_lora=True,
    max_lora_rank=R,
    max_loras=1,
)  # the server's flags (commands.py); add the fixes' flags here
NP, NT = int(os.environ.get("LS_PROMPTS", 64)), int(os.environ.get("LS_TOKENS", 128))
prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 200 + 10 for j in range(40)]) for i in range(NP)]
sp = SamplingParams(max_tokens=NT, min_tokens=NT, ignore_eos=True, temperature=0.0, seed=0)
res = {}


def arm(name, lora, warm=True):
    if warm:
        llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
    n0 = len(loads)
    sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t
    toks = [o.outputs[0].token_ids[:8] for o in outs[:4]]
    res[name] = {"s": round(dt, 3), "adapter_disk_loads": len(loads) - n0, "first_tokens": [list(x) for x in toks]}
    print(f"[lora_speed] {name:16s} {dt:7.3f} s  adapter loads from disk during timed generate: {len(loads) - n0}", flush=True)


arm("base", None)
arm("plain_req", LoRARequest("policy", 1, a1))
arm("inplace_req", LoRARequest("policy", 1, a1, load_inplace=True))
# a push as the server does it (engine add_lora, in place, same id), then requests without the flag
llm.llm_engine.add_lora(LoRARequest("policy", 1, a2, load_inplace=True))
arm("push_then_plain", LoRARequest("policy", 1, a2), warm=False)
res["push_changed_weights"] = res["push_then_plain"]["first_tokens"] != res["plain_req"]["first_tokens"]
llm.llm_engine.add_lora(LoRARequest("policy-3", 2, a3))  # client-only fix: new name/id per push (LRU evicts id 1)
arm("new_id", LoRARequest("policy-3", 2, a3), warm=False)
from trainer.push.vllm_plugin import load_adapters_once  # the checkout on PYTHONPATH (gpu/stack.sh sets it)

load_adapters_once()
arm("inplace_req_patched", LoRARequest("policy-3", 2, a3, load_inplace=True))


def runner_module() -> str:
    """Which model runner served the arms (vllm.v1.worker.gpu.model_runner = V2 on CUDA; V1's on CPU)."""
    try:
        w = llm.llm_engine.model_executor.driver_worker
        return type(getattr(w, "worker", w).model_runner).__module__
    except Exception as e:  # noqa: BLE001 - a figure of the report, never the arms' failure
        return f"? ({e})"


res["model_runner"] = runner_module()
print(
    "[lora_speed]",
    json.dumps(
        {k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "first_tokens"}) for k, v in res.items()}
    ),
    flush=True,
)
if out_json:
    json.dump(res, open(out_json, "w"), indent=1)
