"""The default data section's values of the options the data loaders take as required arguments
(only the loader and the trainers bind the section; tests call PromptDataset.load, load_records and
load_preference_examples directly)."""
from verl_hpc.config import JobConfig

DATA = JobConfig().data


def dataset_args(**changes):
    """PromptDataset.load's data-section options, with `changes` on top."""
    return dict(dict(prompt_key=DATA.prompt_key, max_prompt_length=DATA.max_prompt_length,
                     overlong_prompts=DATA.overlong_prompts, wrap_plain_text=DATA.wrap_plain_text), **changes)


def preference_keys(**changes):
    """load_preference_examples' data-section column names and wrap_plain_text, with `changes` on top."""
    return dict(dict(prompt_key=DATA.prompt_key, chosen_key=DATA.chosen_key, rejected_key=DATA.rejected_key,
                     completion_key=DATA.completion_key, label_key=DATA.label_key,
                     wrap_plain_text=DATA.wrap_plain_text), **changes)
