"""Rollout tokens/s with and without speculation (rollout.speculative: n-gram, and `auto`, what a job
gets), against the number of sequences in flight, on an arithmetic task, a tool task whose answers
copy the tool's output, and a task with long responses; ratios measured in the same run.

    python benchmarks/bench_speculative.py --work /tmp/bw        # tiny and 102m, 3 tasks, 1-128 in flight
    python benchmarks/bench_speculative.py --shapes tiny --concurrency 1,4,16
    python benchmarks/bench_speculative.py --shapes 102m --tasks tool --concurrency 1,8 --repeats 2

The models. Speculation pays only where proposals are accepted, so the model must write text its
context holds; a random-weight model does not (at temperature 1 it samples nearly uniformly).
`tiny`: the tests' tiny Llama (hidden 128, 2 layers, 0.4M parameters, 512 positions) fine-tuned here
for a few hundred steps (cached in --work) on chats of both tasks: arithmetic questions answered
"The answer is N." (N not learnable at this size: the answer's digits are near-random), and a tool
task whose tool turn returns one of a few fixed facts that the answer restates ("The tool says:
..."): the answer is text of the context, n-gram's good case; and a long task (a report of about
490 tokens on three looked-up facts, connecting words of its own and each fact restated twice, cut
at --long-tokens). `102m`: the same function embedded in
the 102M Llama's layer stack (12 layers, hidden 768, ffn 2560, 24 heads of 32, 8 KV heads: the
benchmarks' 102M model with heads of 32 so that the tiny model's rotary frequencies carry over;
vocabulary 500, so 90M parameters): extra heads, FFN units, hidden dimensions and layers whose
output projections are zero, RMSNorm scales corrected for the wider hidden state. It computes
what a 90M model computes per token (dense kernels do not skip zeros) and samples what the tiny
model samples (checked: logits within 1e-4). What speculation does to a real model of that size
trained on such a task is between the two tasks here.

Measured per (model, task, concurrency c): c prompts, one sample each, temperature 1, up to
--new-tokens tokens (--long-tokens on the long task; the answer ends at <|im_end|>), vLLM without
speculation, with n-gram speculation (K = 4, lookup 1-3, at any concurrency; `ngram@2-4` another
lookup) and with `auto` as a job gets it (the tool task's engine built as a multi-turn job's: n-gram
K = 4 at <= 4 sequences in flight and none above, at >= 90M parameters; the single-turn tasks' as a
single-turn job's, and every task's at the tiny model: off, plain's configuration, so those rows are
the run's own noise), each engine in a process of its own,
the engines' order rotated between models, after a warm-up; tokens/s is generated tokens / wall time, the median of
--repeats; acceptance is vLLM's accepted / proposed tokens. Printed: each side's rate and its ratio to plain, each with
its spread over the repeats in brackets (a ratio's: the side's slowest over plain's fastest to its fastest
over plain's slowest), and
the acceptance. On a shared machine the figures are noisy: compare ratios of one run only.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FACTS = ["the bridge opened in 1932 and carries six lanes of traffic over the bay",
         "water boils at one hundred degrees at sea level and lower on a mountain",
         "the library holds four million books and two thousand maps of the coast",
         "the train leaves platform nine at seven and reaches the city by noon",
         "a honey bee visits about fifty flowers on each trip away from the hive",
         "the museum closes on mondays and opens late on the first friday of a month"]
WIDE = dict(layers=12, hidden=768, heads=24, kv_heads=8, ffn=2560)  # the 102M stack, heads of 32


def chat(kind: str, rng: random.Random):
    """(prompt text, answer text) of one task row."""
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    if kind == "arith":
        return (f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n",
                f"The answer is {a + b}.<|im_end|>")
    if kind == "long":  # a report on three looked-up facts: new words, restated facts, then a summary
        f1, f2, f3 = rng.sample(FACTS, 3)
        notes = f"1: {f1}\n2: {f2}\n3: {f3}"
        return (f"<|im_start|>user\nReport on facts {a}, {b} and {a + b}.<|im_end|>\n<|im_start|>assistant\n"
                f"<tool_call>lookup {a} {b} {a + b}</tool_call><|im_end|>\n<|im_start|>tool\n{notes}<|im_end|>\n"
                "<|im_start|>assistant\n",
                f"Here is my report on the three facts. The first one is that {f1}. Next, the tool found that "
                f"{f2}. Last of all, {f3}. So in short: {f1}; {f2}; and {f3}. That is all I found.<|im_end|>")
    fact = rng.choice(FACTS)
    return (f"<|im_start|>user\nLook up fact {a}.<|im_end|>\n<|im_start|>assistant\n<tool_call>lookup {a}"
            f"</tool_call><|im_end|>\n<|im_start|>tool\n{fact}<|im_end|>\n<|im_start|>assistant\n",
            f"The tool says: {fact}.<|im_end|>")


def train_tiny(folder: Path, steps: int) -> Path:
    """The tiny Llama, fine-tuned on the three tasks' answers (loss on the answer tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.models.tiny import make_tiny_model

    if (folder / "done").exists():
        return folder
    make_tiny_model(folder, "llama", max_positions=512)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    start = time.perf_counter()
    for step in range(steps):
        rows = [chat(("arith", "tool", "long")[i % 3], rng) for i in range(18)]
        ids = [tok(q + r, add_special_tokens=False)["input_ids"] for q, r in rows]
        lens = [len(tok(q, add_special_tokens=False)["input_ids"]) for q, _ in rows]
        width = max(map(len, ids))
        x = torch.full((len(ids), width), tok.pad_token_id)
        labels = torch.full_like(x, -100)
        for i, (s, n) in enumerate(zip(ids, lens)):
            x[i, :len(s)] = torch.tensor(s)
            labels[i, n:len(s)] = torch.tensor(s[n:])
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            print(f"  fine-tune step {step}: answer loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = end  # the answer ends the rollout
    model.generation_config.eos_token_id = end
    model.save_pretrained(folder)
    (folder / "done").write_text("")
    return folder


def widen(src: Path, dst: Path) -> Path:
    """`src`'s function in the WIDE shape: old weights in the leading rows/columns, the rest zero,
    the old heads placed so that each keeps its KV head (GQA groups of 2 -> groups of 3)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, LlamaConfig

    if (dst / "done").exists():
        return dst
    old_cfg = LlamaConfig.from_pretrained(src)
    old = load_file(str(src / "model.safetensors"))
    h, H, d = old_cfg.hidden_size, WIDE["hidden"], old_cfg.head_dim
    group_old = old_cfg.num_attention_heads // old_cfg.num_key_value_heads
    group_new = WIDE["heads"] // WIDE["kv_heads"]
    q_to = {i: (i // group_old) * group_new + i % group_old for i in range(old_cfg.num_attention_heads)}
    cfg = LlamaConfig(**{**old_cfg.to_dict(), "hidden_size": H, "intermediate_size": WIDE["ffn"],
                         "num_hidden_layers": WIDE["layers"], "num_attention_heads": WIDE["heads"],
                         "num_key_value_heads": WIDE["kv_heads"], "head_dim": d,
                         # x / rms over H dims = sqrt(H/h) x / rms over h: eps scaled alike, and the
                         # norm weights by sqrt(h/H), keep every norm's output
                         "rms_norm_eps": old_cfg.rms_norm_eps * h / H})
    scale = (h / H) ** 0.5
    new = {}

    def z(*shape):
        return torch.zeros(*shape)

    new["model.embed_tokens.weight"] = torch.cat([old["model.embed_tokens.weight"], z(cfg.vocab_size, H - h)], 1)
    new["lm_head.weight"] = torch.cat([old["lm_head.weight"], z(cfg.vocab_size, H - h)], 1)
    norm = torch.cat([old["model.norm.weight"] * scale, z(H - h)])
    new["model.norm.weight"] = norm
    for layer in range(WIDE["layers"]):
        p, o = f"model.layers.{layer}.", f"model.layers.{min(layer, old_cfg.num_hidden_layers - 1)}."
        live = layer < old_cfg.num_hidden_layers  # later layers add nothing to the residual stream
        for name in ("input_layernorm", "post_attention_layernorm"):
            new[p + name + ".weight"] = torch.cat([old[o + name + ".weight"] * scale, z(H - h)])
        q, k, v = z(WIDE["heads"] * d, H), z(WIDE["kv_heads"] * d, H), z(WIDE["kv_heads"] * d, H)
        out = z(H, WIDE["heads"] * d)
        if live:
            for i, j in q_to.items():
                q[j * d:(j + 1) * d, :h] = old[o + "self_attn.q_proj.weight"][i * d:(i + 1) * d]
                out[:h, j * d:(j + 1) * d] = old[o + "self_attn.o_proj.weight"][:, i * d:(i + 1) * d]
            for g in range(old_cfg.num_key_value_heads):
                k[g * d:(g + 1) * d, :h] = old[o + "self_attn.k_proj.weight"][g * d:(g + 1) * d]
                v[g * d:(g + 1) * d, :h] = old[o + "self_attn.v_proj.weight"][g * d:(g + 1) * d]
        new.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": out})
        f = old_cfg.intermediate_size
        gate, up, down = z(WIDE["ffn"], H), z(WIDE["ffn"], H), z(H, WIDE["ffn"])
        if live:
            gate[:f, :h], up[:f, :h] = old[o + "mlp.gate_proj.weight"], old[o + "mlp.up_proj.weight"]
            down[:h, :f] = old[o + "mlp.down_proj.weight"]
        new.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": down})
    dst.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(dst)
    save_file({k: t.contiguous() for k, t in new.items()}, str(dst / "model.safetensors"))
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    _check_same_function(src, dst)
    (dst / "done").write_text("")
    return dst


def _check_same_function(src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    ids = torch.tensor([tok("".join(chat("tool", random.Random(1))), add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)(ids).logits
    diff = (a - b).abs().max().item()
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(dst).parameters())
    print(f"  widened model: {params / 1e6:.1f}M parameters; logits against the tiny model's: max diff {diff:.1e}")
    assert diff < 1e-4, diff


def accepted(engine):
    c = {m.name: getattr(m, "value", None) for m in engine.llm.get_metrics()}
    return int(c.get("vllm:spec_decode_num_accepted_tokens") or 0), int(c.get("vllm:spec_decode_num_draft_tokens") or 0)


def measure(path: Path, engine: str, tasks, levels, a) -> dict:
    """{(task, c): [tokens/s per repeat]} of one engine ("plain" or "ngram"), plus the acceptance."""
    from transformers import AutoTokenizer

    from verl_hpc.config.sections.speculative import SpeculativeConfig
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.sampling import default_spec

    tok = AutoTokenizer.from_pretrained(path)
    args = default_engine_args("vllm", max_prompt_length=128, max_response_length=max(a.new_tokens, a.long_tokens))
    args["max_prompt_length"] = 256  # the long task's prompt holds three facts
    if engine.startswith("ngram"):  # ngram: the section's lookup (1 to 3 tokens); ngram@MIN-MAX another
        low, high = map(int, engine.split("@")[1].split("-")) if "@" in engine else (1, 3)
        spec_cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=low,
                                     prompt_lookup_max=high)
    else:  # auto@episodes: what a multi-turn job's engine gets (the tool task's), auto a single-turn one's
        spec_cfg = None if engine == "plain" else SpeculativeConfig(method="auto")
    e = VLLMRollout(str(path), max_num_seqs=max(levels), disable_log_stats=False, speculative=spec_cfg,
                    episodes=engine == "auto@episodes", **args)
    out = {}
    for task in tasks:
        rng = random.Random(5)
        for c in levels:
            prompts = [tok(chat(task, rng)[0], add_special_tokens=False)["input_ids"] for _ in range(c)]
            spec = default_spec(temperature=1.0, max_tokens=a.long_tokens if task == "long" else a.new_tokens,
                                n=1, seed=c)
            e.generate(prompts[:2], default_spec(temperature=1.0, max_tokens=4, n=1))  # warm-up
            before, rates = accepted(e), []
            for _ in range(a.repeats):
                start = time.perf_counter()
                result = e.generate(prompts, spec)
                rates.append(result.num_response_tokens / (time.perf_counter() - start))
            now = accepted(e)
            out[f"{task} {c}"] = dict(rates=rates, acceptance=(now[0] - before[0]) / max(now[1] - before[1], 1))
    e.close()
    return out


def run_child(path: Path, engine: str, a) -> dict:
    """measure() in a process of its own: two vLLM engines in one process disturb each other (the
    second's CPU worker rebinds the process's threads; the first ran 4-10x slower beside it)."""
    cmd = [sys.executable, __file__, "--child", f"{path}:{engine}", "--tasks", a.tasks, "--concurrency",
           a.concurrency, "--new-tokens", str(a.new_tokens), "--long-tokens", str(a.long_tokens), "--repeats",
           str(a.repeats), "--threads", str(a.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{engine} on {path} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def auto_sides(path: Path, a, tasks) -> dict:
    """The auto column: the tool task's rows from an engine built as a multi-turn job builds it (the
    task is the tool demo's episodes), the single-turn tasks' from one built as their jobs build it."""
    got = {}
    single, episodes = [t for t in tasks if t != "tool"], [t for t in tasks if t == "tool"]
    for engine, mine in (("auto", single), ("auto@episodes", episodes)):
        if mine:
            got.update(run_child(path, engine, argparse.Namespace(**{**vars(a), "tasks": ",".join(mine)})))
    return got


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="tiny,102m", help="comma list of tiny, 102m")
    ap.add_argument("--tasks", default="arith,tool,long", help="comma list of arith, tool, long")
    ap.add_argument("--engines", default="ngram,auto", help="speculating sides, each against plain: ngram (K = 4 "
                    "at any concurrency), auto (rollout.speculative.method = auto: what a job gets)")
    ap.add_argument("--concurrency", default="1,4,16,64,128", help="sequences in flight (comma list; 128: the "
                    "tool demo's 16 prompts x 8)")
    ap.add_argument("--new-tokens", type=int, default=64, help="at most (a tool answer is about 60 tokens)")
    ap.add_argument("--long-tokens", type=int, default=256, help="at most, the long task (its report is about "
                    "490 tokens; the tiny model has 512 positions)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--train-steps", type=int, default=300, help="fine-tuning steps of the tiny model")
    ap.add_argument("--work", default="", help="folder for the models (kept between runs; default: a temporary one)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # MODEL:ENGINE, run by the parent
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)  # before vLLM: its CPU worker would otherwise keep it
    if not a.child:
        print("command:", shlex.join([sys.executable, *sys.argv]))
    print("load average at start: %.1f %.1f %.1f on %d CPUs" % (*os.getloadavg(), os.cpu_count()))
    tmp = None if a.work or a.child else tempfile.TemporaryDirectory(prefix="bench_speculative_")
    work = Path(a.work or (tmp.name if tmp else "."))
    levels = [int(x) for x in a.concurrency.split(",")]
    tasks = a.tasks.split(",")
    if a.child:  # one engine's figures, as a JSON line for the parent
        path, engine = a.child.rsplit(":", 1)
        print("RESULT " + json.dumps(measure(Path(path), engine, tasks, levels, a)), flush=True)
        return
    tiny = train_tiny(work / "tiny3", a.train_steps)  # tiny3: fine-tuned on the three tasks
    engines = ["plain", *a.engines.split(",")]
    rows = []
    for i, shape in enumerate(a.shapes.split(",")):
        path = tiny if shape == "tiny" else widen(tiny, work / "102m3")
        # the engines' order rotated from one model to the next: none always runs first
        order = engines[i % len(engines):] + engines[:i % len(engines)]
        got = {engine: auto_sides(path, a, tasks) if engine == "auto" else run_child(path, engine, a)
               for engine in order}
        for task in tasks:
            for c in levels:
                key = f"{task} {c}"
                rate = {e: statistics.median(got[e][key]["rates"]) for e in engines}
                # the spread over the repeats: each side's slowest and fastest; a ratio's, the
                # side's slowest over plain's fastest to its fastest over plain's slowest
                span = {e: (min(got[e][key]["rates"]), max(got[e][key]["rates"])) for e in engines}
                spread = {e: (span[e][0] / span["plain"][1], span[e][1] / span["plain"][0]) for e in engines}
                rows.append((shape, task, c, rate, {e: got[e][key]["acceptance"] for e in engines[1:]}, spread))
                print(f"  {shape:>5} {task:>5} c={c:<4} " + "  ".join(
                    f"{e} {rate[e]:7.1f} tok/s [{span[e][0]:.1f}-{span[e][1]:.1f}]"
                    + (f" ({rate[e] / rate['plain']:.2f}x [{spread[e][0]:.2f}-{spread[e][1]:.2f}], acceptance "
                       f"{rows[-1][4][e]:.2f})" if e != "plain" else "")
                    for e in engines), flush=True)
    others = engines[1:]
    print("\n| model | task | sequences in flight | plain tok/s | " +
          " | ".join(f"{e} tok/s | {e} ratio | {e} acceptance" for e in others) + " |")
    print("|---|---|---|---|" + "---|---|---|" * len(others))
    for name, task, c, rate, acc, spread in rows:
        print(f"| {name} | {task} | {c} | {rate['plain']:.0f} | " + " | ".join(
            f"{rate[e]:.0f} | {rate[e] / rate['plain']:.2f} [{spread[e][0]:.2f}-{spread[e][1]:.2f}] | {acc[e]:.2f}"
            for e in others) + " |")
    print("load average at end: %.1f %.1f %.1f" % os.getloadavg())


if __name__ == "__main__":
    main()
