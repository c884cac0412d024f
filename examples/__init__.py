"""Worked examples of extending kvjax (the README's "Write your own")."""
