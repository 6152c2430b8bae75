"""Trust tier: read the faces, trust the body.

The Ray actors of a run, by role ("trainer rank 0", "vLLM engine 1", "reward models"), and
waits on them that end as soon as any of them dies or raises, naming it and the root cause.

Why: a Ray driver that only calls `ray.get` on one actor's result never learns that another
actor died (a vLLM engine that failed to start, a trainer killed by the OOM killer); the actors
still alive then wait in a collective until its timeout. Every actor made with `actor_class`
answers `ping` on a thread of its own, so a wait here pings them all every few seconds.
"""

import os
import re
import socket
import time

import ray

HEALTH = "health"  # the concurrency group `ping` runs in, beside the actor's work


class RoleFailed(RuntimeError):
    """A role of the run died, raised, or did not start in time; the message names it."""


def actor_class(cls, **ray_options):
    """`cls` as a Ray actor class whose `ping` (pid, host) is served while the actor works."""

    def ping(self):
        return os.getpid(), socket.gethostname()

    pingable = type(cls.__name__, (cls,), {"ping": ping, "__module__": cls.__module__})
    return ray.remote(concurrency_groups={HEALTH: 1}, **ray_options)(pingable)


def root_cause(error):
    """The first line worth reading of a Ray error: the exception a task raised, the last
    exception line of a failed actor constructor's traceback, or why the actor's process died."""
    cause = getattr(error, "cause", None)
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        text = str(cause).strip()
        return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"
    text = str(error)
    raised = [m for m in re.finditer(r"^\s*(?:\w+\.)*(\w*(?:Error|Exception|Exit)\w*): (.+)$", text, re.M)]
    if raised:
        return f"{raised[-1].group(1)}: {raised[-1].group(2).strip()}"  # the type without its module path
    died = re.search(r"Worker exit detail: (.+?)(?: There are some potential root causes|$)", text, re.S)
    if died:
        return "its process died: " + " ".join(died.group(1).split())
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


class Roles:
    """Actor handles by role name. `ready()` before anything waits on them (a collective, a
    rendezvous); `get(refs)` instead of `ray.get(refs)` for every wait after that."""

    def __init__(self, poll_s=2.0):
        self.handles, self.poll_s, self._by_actor_id = {}, poll_s, {}

    def add(self, name, handle):
        self.handles[name] = handle
        self._by_actor_id[handle._actor_id.hex()] = name
        return handle

    def _name_of(self, error):
        actor_id = getattr(error, "actor_id", None)
        if not isinstance(actor_id, str):
            m = re.search(r"actor_id[=:]\s*([0-9a-f]{16,})", str(error))
            actor_id = m.group(1) if m else None
        return self._by_actor_id.get(actor_id, "an actor")

    def _raise_failures(self, done, starting=False):
        """RoleFailed for the first of these finished refs that holds an error. A role that raised (a
        collective's "Connection reset", say) often did so because another role's process died: then
        the dead role is named first, as the root cause."""
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                state = "failed to start" if starting else "failed"
                message = f"{self._name_of(e)} {state}: {root_cause(e)}"
                dead = None if isinstance(e, ray.exceptions.RayActorError) else self._dead_role()
                raise RoleFailed(f"{dead}; then {message}" if dead else message) from None

    def _dead_role(self, timeout_s=10.0):
        """'<role> failed: <why its process died>' for a role whose process has died, else None."""
        pings = {h.ping.options(concurrency_group=HEALTH).remote(): name for name, h in self.handles.items()}
        done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=timeout_s)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return f"{pings[ref]} failed: {root_cause(e)}"
        return None

    def ready(self, timeout_s):
        """Wait until every actor's constructor has returned (models loaded, engines started)."""
        pings = {name: h.ping.options(concurrency_group=HEALTH).remote() for name, h in self.handles.items()}
        deadline = time.time() + timeout_s
        pending = list(pings.values())
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending),
                                     timeout=min(self.poll_s, max(deadline - time.time(), 0)))
            self._raise_failures(done, starting=True)
            if pending and time.time() >= deadline:
                late = [name for name, ref in pings.items() if ref in pending]
                raise RoleFailed(f"{', '.join(late)} did not start within {timeout_s:.0f} s")

    def get(self, refs, timeout_s=None, waiting_on="an actor"):
        """ray.get(refs), but a failure of any role ends the wait at once with RoleFailed, and so
        does a wait past timeout_s (the error names `waiting_on`, the role that owes the answer)."""
        pending = list(refs) if isinstance(refs, list) else [refs]
        deadline = None if timeout_s is None else time.time() + timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=self.poll_s)
            self._raise_failures(done)
            if pending:
                self.check_alive()
                if deadline is not None and time.time() > deadline:
                    raise RoleFailed(f"{waiting_on}: no answer within {timeout_s:.0f} s")
        return ray.get(refs)

    def check_alive(self):
        """Ping every role; a dead one raises RoleFailed (one that is busy and slow to answer does not)."""
        pings = [h.ping.options(concurrency_group=HEALTH).remote() for h in self.handles.values()]
        if not pings:
            return
        done, _ = ray.wait(pings, num_returns=len(pings), timeout=self.poll_s)
        self._raise_failures(done)
