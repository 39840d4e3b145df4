"""Multi-turn agents: agent coroutines, the TITO session server, sandboxes (DESIGN.md, "TITO")."""
