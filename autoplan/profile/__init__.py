"""Profile stage: what every unit costs, in bytes and time, under every choice it can take."""
