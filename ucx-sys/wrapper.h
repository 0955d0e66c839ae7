#include <ucp/api/ucp.h>
#include <ucs/type/status.h>
