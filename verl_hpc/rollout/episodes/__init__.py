"""Multi-turn episodes (`multi_turn`; docs/multi_turn.md): model turn, tool or environment turn,
model turn, ... as one token sequence, on whichever engine the job rolls out with.

- build.py        the multi_turn section made into an episode runner (EpisodeOptions)
- runner.py       `EpisodeRunner`: token in, token out, over any rollout engine
- chat_turns.py   the chat template's turn delimiters as token ids

The tools an episode calls are rollout/tools/; agent programs behind an endpoint are rollout/agents/.
"""
