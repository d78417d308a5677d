"""The model-free check of tau2_agent.py's wiring: tau2's own orchestrator, environment and evaluation, with a
scripted agent (the task's reference actions, or the same with one wrong argument, of a write where the task has
one) and a scripted user (it asks
once, then ends the conversation). A right agent must get tau2's reward 1, a wrong one 0."""

from __future__ import annotations

import copy
from typing import Any

from tau2.agent.base import LocalAgent
from tau2.data_model.message import AssistantMessage, ToolCall, UserMessage
from tau2.environment.toolkit import ToolType
from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
from tau2.orchestrator.orchestrator import Orchestrator
from tau2.registry import registry
from tau2.user.base import STOP, BaseUser, UserState


class ScriptedAgent(LocalAgent):
    """Performs `actions` (name, arguments) one tool call per turn, then tells the user it is done, with what the
    task says must be communicated."""

    def __init__(self, tools, domain_policy: str, actions: list[tuple[str, dict]], tell: list[str]) -> None:
        super().__init__(tools=tools, domain_policy=domain_policy)
        self.actions = actions
        self.closing = " ".join(["Done: everything you asked for is taken care of.", *tell])

    def get_init_state(self, message_history=None) -> list:
        return list(self.actions)

    def generate_next_message(self, message, state: list) -> tuple[AssistantMessage, list]:
        if state:
            name, arguments = state.pop(0)
            call = ToolCall(id=f"call-{len(self.actions) - len(state)}", name=name, arguments=arguments)
            return AssistantMessage(role="assistant", tool_calls=[call]), state
        return AssistantMessage(role="assistant", content=self.closing), state


class ScriptedUser(BaseUser):
    """States the request once, then stops."""

    def __init__(self, request: str) -> None:
        super().__init__(instructions=request)
        self.asked = False

    def get_init_state(self, message_history=None) -> UserState:
        return UserState(system_messages=[], messages=list(message_history or []))

    def generate_next_message(self, message, state: UserState) -> tuple[UserMessage, UserState]:
        text = STOP if self.asked else str(self.instructions)
        self.asked = True
        return UserMessage(role="user", content=text), state

    @classmethod
    def is_stop(cls, message: UserMessage) -> bool:
        return STOP in (message.content or "")

    def set_seed(self, seed: int) -> None:
        pass


def reference_actions(task) -> list[tuple[str, dict]]:
    return [(a.name, dict(a.arguments)) for a in (task.evaluation_criteria.actions or []) if a.requestor == "assistant"]


def spoiled(task, writes: set[str]) -> list[tuple[str, dict]] | None:
    """The reference actions with one compared string argument changed, of a write (`writes`: the tools that change
    the domain's state) where there is one: a wrong read whose result goes unused changes nothing tau2 grades.
    None when no argument can be changed."""
    actions = copy.deepcopy(task.evaluation_criteria.actions or [])
    mine = [a for a in actions if a.requestor == "assistant"]
    for action in sorted(mine, key=lambda a: a.name not in writes):
        for arg in action.compare_args if action.compare_args is not None else list(action.arguments):
            if isinstance(action.arguments.get(arg), str):
                action.arguments[arg] = action.arguments[arg] + "-wrong"
                return [(a.name, dict(a.arguments)) for a in mine]
    return None


def simulate(domain: str, task, actions: list[tuple[str, dict]]) -> dict[str, Any]:
    environment = registry.get_env_constructor(domain)()
    agent = ScriptedAgent(environment.get_tools(), environment.get_policy(), actions,
                          list(task.evaluation_criteria.communicate_info or []))
    user = ScriptedUser(f"Hello. {task.description.purpose if task.description else ''} {task.id}")
    simulation = Orchestrator(domain, agent=agent, user=user, environment=environment, task=task, max_steps=60,
                              seed=0).run()
    try:
        reward = evaluate_simulation(simulation=simulation, task=task, evaluation_type=EvaluationType.ALL,
                                     solo_mode=False, domain=domain).reward
    except ValueError:  # a domain's own assertion refusing the final state
        reward = 0.0
    return {"reward": float(reward), "termination": simulation.termination_reason.value}


def check(domain: str) -> list[dict[str, Any]]:
    """One line per task with an action to perform: tau2's reward for the right and the wrong scripted agent."""
    tools = registry.get_env_constructor(domain)().tools
    writes = {name for name in tools.get_tools() if tools.tool_type(name) == ToolType.WRITE}
    lines = []
    for task in registry.get_tasks_loader(domain)():
        if task.evaluation_criteria is None or not reference_actions(task):
            continue
        wrong = spoiled(task, writes)
        lines.append({"task_id": task.id, "actions": len(reference_actions(task)),
                      "right": simulate(domain, task, reference_actions(task)),
                      "wrong": simulate(domain, task, wrong) if wrong is not None else None})
    return lines
