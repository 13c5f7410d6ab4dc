package backup

// TestStore is testStore for the external tests (s3test imports backup, so its tests live outside).
var TestStore = testStore
