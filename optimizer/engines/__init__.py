"""Engines behind one protocol (base.py): the in-process vLLM engine and a scripted fake for fast tests."""
