"""The example of docs/tasks.md: an app whose task sends an invoice, exactly once."""
