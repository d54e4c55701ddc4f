"""Reasoning models: the reasoning block apart from the answer, thinking budgets, the
forced close, a turn that ends inside its reasoning, and the loop guard."""
