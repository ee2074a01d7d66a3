"""Before the queue: a data row's images, through what the job runs on them.

The job decodes each row's images and hands them, with the prompt, to the model's own processor
(verl_hpc.data.processor.ImagePrompts.encode) on rank 0 after the queue: an image that does not
decode, placeholders that do not pair with the images, a picture the processor refuses (Qwen-VL's
aspect-ratio limit), a file over vision.max_image_bytes, or images given to a text-only model would
end the job there. Here the same calls run on every row that holds images, so each is one line
naming the file and row before anything is queued. A vision-language folder whose processor does
not load (no preprocessor_config.json) is one line naming model.path.
"""
from __future__ import annotations

import os
from typing import Optional

from verl_hpc.config import ConfigError


class RowImages:
    """The image rules of one RL job's rows: the column, whether the model takes images, and its
    processor (loaded once, only for a vision-language model)."""

    def __init__(self, cfg):
        from verl_hpc.config.hf_model import is_vision_language, read_hf_config

        self.key = cfg.vision.image_key
        self.problem = ""  # why the processor does not load: reported once, the rows' images then unchecked
        self.prompts = None
        try:
            self.vision = is_vision_language(read_hf_config(cfg.model.path))
        except ConfigError:
            self.vision = False  # the model folder's own check reports it
            return
        if self.vision:
            from verl_hpc.data.processor import ImagePrompts

            try:
                self.prompts = ImagePrompts.from_config(cfg.model, cfg.vision)
            except ConfigError as e:
                self.problem = e.problems[0]

    def problem_of(self, row: dict, prompt_key: str, path: str, sample: str) -> Optional[str]:
        """What the job's image path says of a valid row (row_problems passed), or None: the row
        made into the job's PromptRecord (relative image paths from the file's folder) and encoded."""
        from verl_hpc.data.errors import DataError
        from verl_hpc.data.records import to_record

        if self.prompts is None or not row.get(self.key):
            return None
        try:
            self.prompts.prompt(to_record(row, sample, prompt_key, self.key, os.path.dirname(os.path.abspath(path))))
        except DataError as e:
            return str(e)
        return None
