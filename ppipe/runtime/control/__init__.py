"""Plan control: live plan switches and the re-plan loop that follows the traffic.
"""
