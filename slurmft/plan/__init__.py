"""Plan: pure decisions before any job (checks, estimate, render). Imports neither submit nor watch."""
