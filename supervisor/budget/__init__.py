"""The rate budget: the adaptive policy, and the budgets that hold its state."""
