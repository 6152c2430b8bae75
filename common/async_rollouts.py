"""Asynchronous rollouts (--async_train, opt-in): a thread collects the rollouts of the next K steps while the
trainer updates, and a weight sync waits until the rollouts due on the old weights are collected."""

import contextlib
import queue
import threading

from common.infra.roles import RoleFailed


class Rollouts:
    """Each step's rollout (collect(prompt position, policy version) -> rollout), collected ahead by a thread
    (--async_train, K = --max_staleness > 0): step j's on the weights of update max(j - K, 0) exactly, and a weight
    sync waits until every rollout due on the weights it replaces is collected, so it never overlaps a generation.
    Every wait is bounded by --rollout_timeout."""

    def __init__(self, args, collect, first_step, total_steps, position):
        self.collect, self.position, self.version, self.total = collect, position, first_step, total_steps
        self.ahead = args.async_rollout.max_staleness
        self.timeout_s, self.changed = args.async_rollout.rollout_timeout, threading.Condition()
        self.ready, self.collected, self.error = queue.Queue(), first_step, None
        threading.Thread(target=self._collect_ahead, args=(first_step,), daemon=True, name="rollout").start()

    def _collect_ahead(self, first_step):
        try:
            for j in range(first_step, self.total):
                with self.changed:
                    self.changed.wait_for(lambda: self.version >= j - self.ahead)
                rollout = self.collect(self.position, self.version)
                self.position = rollout.end
                self.ready.put(rollout)
                with self.changed:
                    self.collected = j + 1
                    self.changed.notify_all()
        except BaseException as e:  # re-raised where the driver waits
            self.ready.put(e)
            with self.changed:
                self.error = e
                self.changed.notify_all()

    def next(self, step):
        """The rollout of `step` (0-based)."""
        try:
            rollout = self.ready.get(timeout=self.timeout_s)
        except queue.Empty:
            raise RoleFailed(f"vLLM engines (the rollout of step {step + 1} in the rollout thread): not finished "
                             f"within {self.timeout_s:.0f} s (--rollout_timeout)") from None
        if isinstance(rollout, BaseException):
            raise rollout
        return rollout

    @contextlib.contextmanager
    def new_weights(self):
        """Around a weight sync (or an update that changed no weight): first the engines finish the rollouts due
        on the weights they hold."""
        due = min(self.version + self.ahead + 1, self.total)
        with self.changed:
            if not self.changed.wait_for(lambda: self.collected >= due or self.error, timeout=self.timeout_s):
                raise RoleFailed(f"vLLM engines (the rollouts up to step {due} in the rollout thread): not "
                                 f"finished within {self.timeout_s:.0f} s (--rollout_timeout)")
            if self.error is not None:
                raise self.error
        yield
        with self.changed:
            self.version += 1
            self.changed.notify_all()
