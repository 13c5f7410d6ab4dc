package components

// NamespaceGuardForTest exposes the berth-system guard's objects to the external tests.
var NamespaceGuardForTest = namespaceGuard
