"""The agents a harness runs: the built-in tool-using agent over the Anthropic Messages API (`agent.py`),
its branching variant with compaction, sub-agents and call retries (`branching.py`), and an example
command-line agent on the OpenAI SDK (`openai_agent.py`: `python -m gyre.rollout.agents.openai_agent`).
May import the tasks (and config, procs).
"""
