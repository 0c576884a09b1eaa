"""The context-manager and finaliser boilerplate of objects that own native resources."""
from __future__ import annotations


class Closing:
    """Mixin for a class with an idempotent ``close()``: ``with obj:`` closes it on exit and
    the finaliser closes it when it is collected (errors there are ignored)."""

    def close(self) -> None:  # pragma: no cover - every subclass defines its own
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass
