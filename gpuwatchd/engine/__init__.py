"""The poll cycle (collect, assess, plan, carry out) and the edges it reads and acts through."""
