"""A minimal checkpoint participant for the tests of the checkpoint manager:
an object with ``state_dict`` / ``load_state_dict`` and nothing else."""


class Counter:
    """One integer of state."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
