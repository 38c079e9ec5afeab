"""LLM API calls: what a call asks for and spends, the budgets it counts against, spend reports."""
