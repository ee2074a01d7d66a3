"""Image batches and a float64 transformers reference for the vision-language tests (the FSDP engine's
unit and multi-rank tests): rows of image prompts built with the model's own processor path
(verl_hpc.data.processor), random pictures, random responses.
"""
import torch


def image_batch(folder, seed=0, sizes=((70, 100), (56, 56), None, (84, 60, 60, 84)), response=6, repeats=None,
                question=None):
    """Rows of the engines' batch format from image prompts: `sizes` per prompt (h, w) of one image,
    (h, w, h2, w2) of two, None for a text-only prompt; random responses. `repeats`: responses per
    prompt (GRPO's groups: the rows of a prompt share its token ids and its image tensors);
    `question`: one text for every prompt (then two pictures of one size tokenize alike)."""
    from PIL import Image

    from verl_hpc.data.processor import VisionProcessor, image_messages
    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    vp = VisionProcessor.load(str(folder))
    g = torch.Generator().manual_seed(seed)
    prompts, inputs = [], []
    for i, size in enumerate(sizes):
        dims = [] if size is None else [size[k:k + 2] for k in range(0, len(size), 2)]
        images = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
                  for h, w in dims]
        messages, _ = image_messages("".join("<image>" for _ in images) + (question or f"What is shown {i}?"))
        ids, inp = vp.encode(vp.render(messages), images)
        for _ in range(repeats[i] if repeats else 1):
            prompts.append(ids)
            inputs.append(inp or None)
    responses = [torch.randint(5, 480, (response - i % 3,), generator=g).tolist() for i in range(len(prompts))]
    batch = pack_sequences(prompts, responses)
    mask = get_response_mask(batch)
    batch.update(response_mask=mask, image_inputs=inputs,
                 advantages=torch.randn(mask.shape, generator=g) * mask,
                 old_log_probs=(-6.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask,
                 ref_log_probs=(-6.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask)
    return batch, vp


def hf_logprobs64(folder, batch, image_token_id):
    """float64 transformers, each row alone with its own images."""
    from transformers import AutoModelForImageTextToText

    from update_reference import response_outputs
    from verl_hpc.data.processor import token_types

    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float64).eval()
    rows = []
    with torch.no_grad():
        for b in range(batch["input_ids"].shape[0]):
            n = int(batch["prompt_lengths"][b] + batch["response_lengths"][b])
            ids = batch["input_ids"][b:b + 1, :n]
            inp = batch["image_inputs"][b] or {}
            extra = {k: v.double() if v.is_floating_point() else v for k, v in inp.items()}
            if inp:
                extra["mm_token_type_ids"] = token_types(ids, image_token_id)
            logits = model(input_ids=ids, **extra).logits
            one = {k: v[b:b + 1] for k, v in batch.items() if isinstance(v, torch.Tensor)}
            one["input_ids"] = ids
            logp, _, _ = response_outputs(logits, one)
            rows.append(logp[0])
    width = max(len(r) for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
