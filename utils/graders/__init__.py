"""The exercises' graders, one module per lab: each takes the learner's function and says PASS or the hint meant for the mistake."""
