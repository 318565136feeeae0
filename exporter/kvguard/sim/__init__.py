"""The serving simulator: vLLM-shaped startup and traffic driving the allocator models
(``kvguard.allocators``) on a simulated device, and the guard applied to the run.

See ``kvguard.sim.scenario`` for the stepper API.
"""
