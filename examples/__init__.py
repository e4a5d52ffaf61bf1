"""Example apps that show how to build on FairQueue (docs/tasks.md)."""
