"""temp"""
class ShardlineError(Exception): pass
class CollectiveTimeoutError(ShardlineError, TimeoutError): pass
class PeerLostError(ShardlineError, ConnectionError): pass
class CollectiveMismatchError(ShardlineError, ValueError): pass
class InvalidArgumentError(ShardlineError, ValueError): pass
class AuthenticationError(ShardlineError, PermissionError): pass
class ProtocolError(ShardlineError): pass
class TransportError(ShardlineError, OSError): pass
class CommunicatorClosedError(ShardlineError): pass
