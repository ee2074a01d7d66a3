"""A user environment for the multi_turn tests (multi_turn.environment=agent_env:OneMoreTurn): after
the model's first turn it always answers with an observation and a per-turn reward, so every episode
has two model turns with environment tokens between them, whatever a random model writes, and a
per-turn reward that depends on what it wrote."""


class OneMoreTurn:
    def reset(self, row):
        self.left = 1

    def step(self, turn_text):
        if self.left:
            self.left -= 1
            # a reward that differs between samples, so GRPO's advantages are not all zero
            return f"you wrote {len(turn_text)} characters; once more", (len(turn_text) % 3) / 4, False
        return None, 0.0, True
