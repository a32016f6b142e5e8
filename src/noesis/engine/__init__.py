"""Engine: schedule -> run -> finish, one step at a time."""
