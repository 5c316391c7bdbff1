"""The ``Mux``: which steps, workflows and schedules a supervisor serves, by name (the
seed's ``Mux``), and the attempt hooks its children run.
"""

from __future__ import annotations

from typing import Any, Callable

from .backoff import Backoff, compute_backoff
from .durations import Duration
from .errors import ConfigurationError, UnknownStep
from .schedules import Schedule, define
from .steps import DEFAULT_MAX_SNOOZES, Step, handler_ref
from .workflow import Workflow


class Mux:
    """Maps step and workflow names to their definitions (the seed's ``Mux``).

    A supervisor claims only the steps its mux registers.
    """

    def __init__(self) -> None:
        self._steps: dict[str, Step] = {}
        self._workflows: dict[str, Workflow] = {}
        self._schedules: dict[str, Schedule] = {}
        self.hooks: dict[str, list[Callable[..., Any]]] = {"start": [], "end": [], "discarded": []}

    # -- hooks -------------------------------------------------------------------------------

    def on_attempt_start(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register ``fn(ctx)``, called in the child before every handler of this mux runs
        (set up a logging context, a database session...). Decorator; returns ``fn``. It
        must be defined at module level (children import it by name, as handlers). One
        that raises fails the attempt as the handler would (``error``, retried).

        Raises:
            ConfigurationError: ``fn`` is not callable or not importable by module path.
        """
        return self._hook("start", fn)

    def on_attempt_end(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register ``fn(ctx, outcome)``, called in the child after every handler of this
        mux, whatever happened: ``outcome`` is ``{"ok": bool, "kind": error kind or None,
        "error": message or None}`` (a cancel, a timeout the handler saw and a raised
        error included; not a kill, which ends the child). What it raises is printed to
        the child's stderr and changes nothing. Decorator; returns ``fn``.

        Raises:
            ConfigurationError: ``fn`` is not callable or not importable by module path.
        """
        return self._hook("end", fn)

    def on_step_discarded(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Register ``fn(event)``, called in the supervisor (on a thread of its own, never
        in the way of its work) each time it writes a step discarded: ``event`` is
        ``{"run_id", "node", "step_name", "error_kind", "error"}`` (alert someone, open a
        ticket). The supervisor that wrote the discard calls it: the one whose attempt
        failed for good, or whose sweep settled it. Decorator; returns ``fn``.

        Raises:
            ConfigurationError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise ConfigurationError("on_step_discarded takes a callable")
        self.hooks["discarded"].append(fn)
        return fn

    def _hook(self, when: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise ConfigurationError(f"on_attempt_{when} takes a callable")
        ref = handler_ref(fn)
        if not ref.importable():
            raise ConfigurationError(f"hook {ref.qualname} runs in the children, which import it by name: define "
                                     f"it at module level of an importable module (it is in {ref.module})")
        self.hooks[when].append(fn)
        return fn

    def hook_refs(self) -> dict[str, list[dict[str, Any]]]:
        """The attempt hooks as the children find them (``{"start": [ref...], "end": [...]}``,
        empty lists dropped)."""
        refs = {}
        for when in ("start", "end"):
            found = [handler_ref(fn) for fn in self.hooks[when]]
            if found:
                refs[when] = [{"module": r.module, "qualname": r.qualname, "path": r.path} for r in found]
        return refs

    def schedule(
        self,
        target: Step | Workflow | None = None,
        *,
        cron: str | None = None,
        every: Duration | None = None,
        input: Any = None,
        tz: str = "UTC",
        name: str | None = None,
        catch_up: str = "latest",
    ) -> Any:
        """Run ``target`` periodically: at the slots of a ``cron`` expression read in time
        zone ``tz``, or every ``every`` seconds (sub-minute too), each run with ``input``.

        Registers ``target``. Every supervisor whose mux defines the schedule may enqueue
        its due slots; each slot gets exactly one run, decided on the database clock.
        ``catch_up`` says what becomes of slots missed while no supervisor ran:
        ``"latest"`` (one run, the most recent), ``"all"`` or ``"none"``. ``name``
        (default: the target's name) identifies the schedule; a schedule no longer
        defined by any supervisor stops firing. Without ``target`` it is a decorator::

            @mux.schedule(every=30)
            @cy.step("refresh")
            def refresh(ctx, inp): ...

        Returns the :class:`~cyclone_mp.schedules.Schedule` (the target, as a decorator).

        Raises:
            ConfigurationError: a bad expression, zone, interval or policy, a step whose
                concurrency key cannot be computed from ``input``, or another schedule
                already has that name.
        """
        if target is None:
            def decorate(item: Step | Workflow) -> Step | Workflow:
                self.schedule(item, cron=cron, every=every, input=input, tz=tz, name=name, catch_up=catch_up)
                return item
            return decorate
        definition = define(target, name=name, cron=cron, every=every, tz=tz, input=input, catch_up=catch_up)
        self.register(target)
        existing = self._schedules.get(definition.name)
        if existing is not None and existing != definition:
            raise ConfigurationError(f"a different schedule named {definition.name!r} is already defined; pass name=...")
        self._schedules[definition.name] = definition
        return definition

    @property
    def schedules(self) -> dict[str, Schedule]:
        """A copy of the name -> Schedule mapping (``mux.schedule``)."""
        return dict(self._schedules)

    def register(self, *items: Step | Workflow) -> "Mux":
        """Register steps or workflows; returns the mux so calls can chain.

        Registering a workflow also registers each of its steps.

        Raises:
            ConfigurationError: not a Step/Workflow, or a different object already
                holds that name.
        """
        for item in items:
            if isinstance(item, Step):
                existing = self._steps.get(item.name)
                if existing is not None and existing is not item and existing.fn is not item.fn:
                    raise ConfigurationError(f"a different step named {item.name!r} is already registered")
                if item.name in self._workflows:
                    raise ConfigurationError(f"{item.name!r} is already registered as a workflow")
                self._steps[item.name] = item
            elif isinstance(item, Workflow):
                if item.name in self._steps:
                    raise ConfigurationError(f"{item.name!r} is already registered as a step")
                self._workflows[item.name] = item
                for node in item.task_nodes():
                    self.register(node.step)
            else:
                raise ConfigurationError(f"can only register cy.step(...) objects or cy.Workflow, not {type(item).__name__}")
        return self

    def step(self, name: str) -> Step:
        """Return the step registered under ``name``.

        Raises:
            UnknownStep: nothing of that name is registered.
        """
        try:
            return self._steps[name]
        except KeyError:
            raise UnknownStep(f"unknown step {name!r}; registered: {', '.join(sorted(self._steps)) or 'none'}") from None

    def lookup(self, name: str) -> Step | Workflow:
        """Return the step or workflow named ``name``; raises :class:`UnknownStep`."""
        if name in self._workflows:
            return self._workflows[name]
        return self.step(name)

    @property
    def step_names(self) -> list[str]:
        """Names of every registered step, sorted."""
        return sorted(self._steps)

    @property
    def steps(self) -> dict[str, Step]:
        """A copy of the name -> Step mapping."""
        return dict(self._steps)

    @property
    def workflows(self) -> dict[str, Workflow]:
        """A copy of the name -> Workflow mapping."""
        return dict(self._workflows)

    def backoff_for(self, step_name: str | None, default: Backoff | None = None) -> Callable[[int], float]:
        """The callable backoff for a failed attempt of ``step_name`` whose row stores no
        spec: the step's own callable, else ``default`` (the client's) if callable, else
        ``attempt**4`` +-10 % (a spec stored on the row wins over all of these)."""
        step = self._steps.get(step_name or "")
        own = step.options.backoff if step else None
        fn = own if callable(own) else default
        return lambda n: compute_backoff(fn if callable(fn) else None, n)

    def max_snoozes(self, step_name: str | None) -> int:
        """How many times ``step_name`` may raise ``cy.Snooze`` (``cy.step(max_snoozes=...)``,
        default :data:`DEFAULT_MAX_SNOOZES`)."""
        step = self._steps.get(step_name or "")
        own = step.options.max_snoozes if step else None
        return DEFAULT_MAX_SNOOZES if own is None else own
